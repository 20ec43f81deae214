"""The event-loop half of a generation: the output pipeline.

`Generation` turns the pieces the decode thread produces into reply events: it runs
the UTF-8/stop-sequence filter, hands the text (and its logprobs) to a `ReplySink`
in batches, then the final `done` (with usage and timings) or an error, and counts
the outcome in `stats` once. The sink is the front end's: an NDJSON connection's
reply slot encodes protocol lines, the OpenAI listener server-sent events or one
JSON body. Which slot it runs in and when it starts is the scheduler's business,
which it tells through `on_released`.

Event loop only. What it hands the decode thread is frozen (`job`, a JobSpec, and the
scheduler's `placement`); what comes back comes through its `channel` only: pieces as
they are drawn, then the `JobEnd` (engine/crossing.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

from sfcore_daemon.core import errors
from sfcore_daemon.core.logprobs import LogprobTrail
from sfcore_daemon.core.request import RequestId, ToolCall
from sfcore_daemon.core.result import (
    FinishReason,
    Result,
    SamplerSettings,
    Timings,
    TokenLogprob,
    Usage,
)
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.core.textstream import TextStream
from sfcore_daemon.core.tools import CALL_MARKER, MarkerSplit, read_calls
from sfcore_daemon.engine.crossing import NOT_RUN, Channel, JobEnd, JobSpec, Placement
from sfcore_daemon.llama.sampling import Sampling
from sfcore_daemon.structured.grammar import GrammarDeadEnd, GrammarSampler

log = logging.getLogger(__name__)


class ReplySink(Protocol):
    """Where one generation's reply goes, as events the front end encodes.

    `token` and `flush` may come many times; then exactly one of `done`, `error`
    (each the last word: the sink closes) or `close` (the client is gone: nothing
    more is said). Any call may find the client gone and abandon the generation
    before it returns."""

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        """Streamed text (stream true), with its tokens' logprobs if asked for."""
        ...

    def flush(self) -> None:
        """The end of a batch of `token` calls: send what they gathered."""
        ...

    def queued(self, position: int, depth: int) -> None:
        """A streamed request waits: `position` in the wait queue (1 starts next) of
        `depth` waiting; told on entering and whenever the position changes."""
        ...

    def done(self, reply: Result) -> None: ...

    def error(self, code: str, message: str) -> None: ...

    def close(self) -> None: ...


class Generation:
    """One generate or chat request, from the moment it is queued until its last line
    is written. Its outcome is counted in `stats` exactly once, when it is decided."""

    def __init__(
        self,
        *,
        request_id: RequestId,
        stream: bool,
        stops: tuple[str, ...],
        prompt: list[int],
        sampling: Sampling,
        max_tokens: int,
        cache_prompt: bool,
        sink: ReplySink,
        arrived_ns: int,
        loop: asyncio.AbstractEventLoop,
        stats: Stats,
        grammar: GrammarSampler | None = None,
        speculative: bool = False,
        logprobs: int | None = None,
        grammar_trigger: bytes | None = None,
        calls: MarkerSplit | None = None,
        pins: tuple[tuple[int, int], ...] = (),
        cache_key: str | None = None,
        model_fingerprint: str = "",
        priority: str = "interactive",
    ) -> None:
        self.request_id = request_id
        self.model_fingerprint = model_fingerprint
        self.stream = stream
        self.sink = sink
        self.arrived_ns = arrived_ns
        # A reply written whole at the end needs no drain per step, unless a stop
        # sequence may end it early (the drain watches for it).
        wake_each_step = stream or bool(stops)
        self.job = JobSpec(prompt, sampling, max_tokens, cache_prompt, grammar, speculative,
                           logprobs, grammar_trigger, wake_each_step, pins,
                           priority=priority)
        self.cache_key = cache_key  # prompt_cache_key: the scheduler's hint of a slot
        self.channel = Channel(loop, self._drain, self._finished,
                               wake_each_step=wake_each_step)
        # Set by the scheduler as it submits the job; None while it waits.
        self.placement: Placement | None = None
        # How the job ended, once the decode thread has said (its last word).
        self.end: JobEnd | None = None
        # Counted before the end came (the client left): the decode thread's figures
        # are counted when it comes.
        self._unaccounted = False
        # Read now: the grammar is the decode thread's once submitted.
        self._grammar_field = grammar.field if grammar is not None else "grammar"
        self._text = TextStream(stops)
        # A chat with tools: the text after the call marker is the call (tools.py).
        self._calls = calls
        self._parts: list[str] = []
        # Asked for logprobs: each token's entry on its way to a line (logprobs.py), and
        # those a `done` line carries (stream false: all of them).
        self._trail = LogprobTrail(self.channel.numbers) if logprobs is not None else None
        self._entries: list[TokenLogprob] = []
        self.completion_tokens = 0
        self._first_token_ns = 0
        self._last_token_ns = 0
        # True once nothing more may be written: done/error sent, or the client is gone.
        self.replied = False
        # Times a later request started ahead of this one while it waited for room.
        self.overtaken = 0
        # The wait-queue position its client was last told (0: none yet).
        self._position = 0
        # Set by the scheduler that starts it: told once the job has ended, so that it
        # frees the slot.
        self.on_released: Callable[[Generation], None] | None = None
        self._stats = stats

    # --- called by the scheduler and the connection --------------------------------------

    def cancel(self) -> None:
        """End the generation early; its `done` says `cancelled` (cancel op, shutdown)."""
        self.channel.stop()

    def abandon(self) -> None:
        """The client is gone: stop at the next token and write nothing more."""
        self.channel.stop()
        if not self.replied:
            self.replied = True
            self._record("cancelled")
            self.sink.close()

    def fail(self, code: str, message: str) -> None:
        """Answer with an error instead of running (used for queued requests)."""
        if not self.replied:
            self.replied = True
            self._record("error")
            self._stats.errors[code] += 1
            self.sink.error(code, message)

    def cancel_queued(self) -> None:
        """Answer a request that never ran: `done`, finish_reason "cancelled"."""
        if not self.replied:
            self._reply_done("cancelled")

    def queued(self, position: int, depth: int) -> None:
        """Where it waits now (scheduler.py); a streamed reply tells its client when
        the position is new. A reply written whole says nothing before its end."""
        if self.stream and not self.replied and position != self._position:
            self._position = position
            self.sink.queued(position, depth)

    # --- called on the event loop by the decode thread's wake-ups -----------------------

    def _drain(self) -> None:
        channel = self.channel
        pieces = channel.pieces
        if self.replied or self._text.stop_hit is not None:
            pieces.clear()
            channel.numbers.clear()
            return
        text_stream, stream, trail, sink = self._text, self.stream, self._trail, self.sink
        gaps = self._stats.token_gap
        entries = None
        while pieces:
            piece, sampled_ns = pieces.popleft()
            if self.completion_tokens:
                gaps.observe_ns(sampled_ns - self._last_token_ns)
            else:
                self._first_token_ns = sampled_ns
            self.completion_tokens += 1
            self._last_token_ns = sampled_ns
            if trail is None:
                text = text_stream.feed(piece)
            else:
                text, entries = trail.feed(text_stream, piece)
            if self._calls is not None and text:
                text = self._calls.feed(text)
                if not text and entries:  # a call's tokens: their entries go with `done`
                    self._entries += entries
            if text:
                if stream:
                    sink.token(text, entries)
                else:
                    self._parts.append(text)
                    if entries:
                        self._entries += entries
            if text_stream.stop_hit is not None:
                # The decode thread ends the job within a step; `done` (its usage and
                # timings are the end record's) goes when it has.
                channel.stop()
                pieces.clear()
                sink.flush()
                return
        sink.flush()

    def _finished(self, end: JobEnd) -> None:
        """The decode thread's last word on this job: every piece is in."""
        self.end = end
        # The slot is released whatever happens here: a bug in writing the last
        # lines must never leave the slot busy for ever.
        try:
            self._drain()
            if self._unaccounted:
                self._unaccounted = False
                self._stats.cached_tokens += end.n_cached
                _account(self._stats, end, self)
            if not self.replied:
                if self._text.stop_hit is not None:
                    self._reply_done("stop_sequence")
                elif end.end_reason == "error":
                    self._fail_with(end.error)
                else:
                    tail = self._text.finish()
                    if self._calls is not None:
                        tail = self._calls.feed(tail) + self._calls.finish()
                    if tail:
                        self._emit_tail(tail)
                    # end_reason is "stop", "length" or "cancelled" here ("error" is above).
                    self._reply_done("stop_sequence" if self._text.stop_hit is not None
                                     else cast(FinishReason, end.end_reason))
        except Exception:
            log.exception("finishing generation %r failed", self.request_id)
            self.fail(errors.INTERNAL, "unexpected error in the daemon; see its log")
        finally:
            if self.on_released is not None:
                self.on_released(self)

    def _emit_tail(self, tail: str) -> None:
        """The text held back until the end."""
        trail = self._trail
        entries = trail.emitted(len(tail)) if trail is not None else None
        if self.stream:
            self.sink.token(tail, entries)
            self.sink.flush()
        else:
            self._parts.append(tail)
            if entries:
                self._entries += entries

    def _fail_with(self, error: BaseException | None) -> None:
        if isinstance(error, GrammarDeadEnd):
            # The request's own grammar, not a fault of the daemon: no traceback.
            log.info("generation %r: %s", self.request_id, error)
            if error.at_start:
                self.fail(errors.INVALID_REQUEST, f"{error} - at `$.{self._grammar_field}`")
            else:
                self.fail(errors.GRAMMAR_DEAD_END,
                          f"{error} after {self.completion_tokens} tokens; the text so far "
                          "was streamed")
            return
        log.error("generation %r failed", self.request_id, exc_info=error)
        self.fail(errors.INTERNAL, "the model failed while generating; see the daemon log")

    def _record(self, outcome: str) -> None:
        """Count the outcome, decided now, with the decode thread's figures: those of
        its end record, or none for a job that never ran, or, while it runs (the
        client left), from its end record when that comes."""
        end = self.end
        if end is None and self.placement is None:
            end = NOT_RUN
        self._stats.generation_ended(outcome, len(self.job.prompt),
                                     end.n_cached if end is not None else 0,
                                     self.completion_tokens, self.decode_ns())
        if end is None:
            self._unaccounted = True
        else:
            _account(self._stats, end, self)

    @property
    def truncated(self) -> bool:
        """Closed early to fit max_tokens, and the reply is that whole document."""
        end = self.end
        return (end is not None and end.closed_early and end.end_reason == "stop"
                and self._text.stop_hit is None)

    def decode_ns(self) -> int:
        """From the first token to the last (the first's time is the decode thread's
        t_first: its piece carries it)."""
        return self._last_token_ns - self._first_token_ns if self.completion_tokens > 1 else 0

    def _tool_calls(self, reason: FinishReason) -> tuple[FinishReason, list[ToolCall] | None]:
        """The answer's calls, if it made any: read from the text after the marker.
        Text that does not read as whole calls (an "auto" answer cut short before its
        grammar took hold) is given back as text."""
        calls = self._calls
        if calls is None or calls.call is None or reason == "cancelled":
            return reason, None
        text = "".join(calls.call)
        calls.call = None
        made = read_calls(text)
        if made is not None:
            return "tool_calls", made
        # The model wrote the marker of an "auto" call; a forced call's is the prompt's.
        self._emit_tail(("" if calls.forced else CALL_MARKER) + text)
        return reason, None

    def _reply_done(self, reason: FinishReason) -> None:
        if self.replied:
            # A line written just before (the text up to a stop sequence, the held-back
            # tail) dropped the connection, and that counted the request as cancelled.
            return
        reason, tool_calls = self._tool_calls(reason)
        if self.replied:  # giving back the call's text dropped the connection
            return
        self.replied = True
        self._record(reason)
        end = self.end or NOT_RUN
        self.sink.done(Result(
            id=self.request_id,
            text="" if self.stream else "".join(self._parts),
            finish_reason=reason,
            stop_sequence=self._text.stop_hit,
            truncated=self.truncated,
            usage=Usage(
                prompt_tokens=len(self.job.prompt),
                cached_tokens=end.n_cached,
                completion_tokens=self.completion_tokens,
                drafted_tokens=end.drafted,
                accepted_tokens=end.accepted,
                forced_drafted_tokens=end.forced_drafted,
                forced_accepted_tokens=end.forced_accepted,
                cache_write_tokens=max(0, end.pinned - end.n_cached),
            ),
            timings=_timings(self, end),
            logprobs=self._done_entries(),
            tool_calls=tool_calls,
            model_fingerprint=self.model_fingerprint,
            sampler=_sampler_of(self.job.sampling),
            seed=self.job.sampling.seed if self.job.sampling.temperature > 0 else None,
        ))

    def _done_entries(self) -> list[TokenLogprob] | None:
        """The entries the `done` line carries: with stream false all of them; else
        those no token line took. None when the request asked for none."""
        trail = self._trail
        if trail is None:
            return None
        if self._text.stop_hit is None:
            self._entries += trail.rest()
        return self._entries



def _timings(generation: Generation, end: JobEnd) -> Timings:
    now = time.perf_counter_ns()
    started = end.t_start or now
    prompt_ns = end.t_prompt_done - end.t_start if end.t_prompt_done else 0
    evaluated = len(generation.job.prompt) - end.n_cached
    decode_ns = generation.decode_ns()
    arrived = generation.arrived_ns
    return Timings(
        queued_ms=_ms(started - arrived),
        prompt_ms=_ms(prompt_ns),
        prompt_tok_s=_rate(evaluated, prompt_ns),
        first_token_ms=_ms(end.t_first - arrived) if end.t_first else 0.0,
        decode_ms=_ms(decode_ns),
        decode_tok_s=_rate(generation.completion_tokens - 1, decode_ns),
        total_ms=_ms(now - arrived),
        cache_source=end.cache_source,
    )


def _sampler_of(sampling: Sampling) -> SamplerSettings:
    return SamplerSettings(
        temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty)


def _account(stats: Stats, end: JobEnd, generation: Generation) -> None:
    """The decode thread's figures of `generation`'s job, counted once; its failures
    logged."""
    request_id = generation.request_id
    # Only what happened: a request answered before it ran has no queue wait.
    if end.t_start:
        stats.queue_wait.observe_ns(max(end.t_start - generation.arrived_ns, 0))
    if end.t_first:
        stats.first_token.observe_ns(max(end.t_first - generation.arrived_ns, 0))
    if generation.job.grammar is not None:
        stats.grammar_requests += 1
        stats.grammar_tokens += end.grammar_tokens
        stats.grammar_resampled += end.grammar_resampled
        stats.grammar_closed_early += generation.truncated
    stats.cache_hit(end.cache_source, end.n_cached)
    if end.restore_failed:
        log.warning("generation %r: llama.cpp refused a stored prompt state; "
                    "its prompt was evaluated instead", request_id)
    for notice in end.notices:
        log.warning("generation %r: %s", request_id, notice)
    for what, error in end.contained:
        log.warning("generation %r: %s failed (%s); the request went on without it",
                    request_id, what, error, exc_info=error)
    if end.drafted:
        stats.speculative_requests += 1
        stats.drafted_tokens += end.drafted
        stats.accepted_tokens += end.accepted
        stats.forced_drafted += end.forced_drafted
        stats.forced_accepted += end.forced_accepted
        stats.draft_steps += end.draft_steps
        stats.aligned_steps += end.aligned_steps
        stats.logit_rows += end.logit_rows


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def _rate(count: int, ns: int) -> float:
    return round(count * 1e9 / ns, 2) if ns > 0 and count > 0 else 0.0
