"""The wait queue and the decode slots, and the event-loop half of a generation.

`Generation` turns the pieces the decode thread produces into protocol lines: it
runs the UTF-8/stop-sequence filter, encodes `token` lines in batches, and writes
the final `done`. `Scheduler` keeps one FIFO for every connection and hands the
engine a job whenever a slot and room in the KV pool are free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Protocol, cast

from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.kvcache import shared_prefix
from sfcore_daemon.llama.sampling import Sampling
from sfcore_daemon.serve import protocol
from sfcore_daemon.serve.protocol import (
    DoneReply,
    ErrorReply,
    FinishReason,
    RequestId,
    SlotUse,
    Timings,
    TokenReply,
    Usage,
)
from sfcore_daemon.serve.stats import Stats
from sfcore_daemon.serve.textstream import TextStream
from sfcore_daemon.structured.grammar import GrammarDeadEnd, GrammarSampler

log = logging.getLogger(__name__)


# Tokens in common with a slot's cache that make a request go to that slot even
# though most of what the slot holds would be overwritten.
_WORTHWHILE_PREFIX = 64


# How often later requests may start ahead of a waiting one that does not fit yet.
_MAX_OVERTAKES = 8


class ReplySink(Protocol):
    """Where one request's reply lines go (a connection keeps them in request order)."""

    def write(self, data: bytes | bytearray) -> None: ...

    def close(self) -> None: ...


class QueueFull(Exception):
    pass


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
        exclusive: bool = False,
        grammar: GrammarSampler | None = None,
        speculative: bool = False,
    ) -> None:
        self.request_id = request_id
        self.stream = stream
        self.sink = sink
        self.arrived_ns = arrived_ns
        self.job = Job(
            prompt, sampling, max_tokens, cache_prompt,
            loop=loop, on_pieces=self._drain, on_finished=self._finished, grammar=grammar,
            speculative=speculative,
        )
        self.job.exclusive = exclusive
        self._text = TextStream(stops)
        self._parts: list[str] = []
        self.completion_tokens = 0
        self._last_token_ns = 0
        # True once nothing more may be written: done/error sent, or the client is gone.
        self.replied = False
        # Times a later request started ahead of this one while it waited for room.
        self.overtaken = 0
        self._scheduler: Scheduler | None = None
        self._stats = stats

    # --- called by the scheduler and the connection --------------------------------------

    def cancel(self) -> None:
        """End the generation early; its `done` says `cancelled` (cancel op, shutdown)."""
        self.job.stop_requested = True

    def abandon(self) -> None:
        """The client is gone: stop at the next token and write nothing more."""
        self.job.stop_requested = True
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
            self.sink.write(protocol.encode_line(
                ErrorReply(id=self.request_id, code=code, message=message)))
            self.sink.close()

    def cancel_queued(self) -> None:
        """Answer a request that never ran: `done`, finish_reason "cancelled"."""
        if not self.replied:
            self._reply_done("cancelled")

    # --- called on the event loop by the decode thread's wake-ups -----------------------

    def _drain(self) -> None:
        job = self.job
        # Cleared before reading, so a piece appended meanwhile schedules another drain.
        job.wake_pending = False
        pieces = job.pieces
        if self.replied:
            pieces.clear()
            return
        text_stream, stream = self._text, self.stream
        batch = bytearray()
        while pieces:
            piece, sampled_ns = pieces.popleft()
            self.completion_tokens += 1
            self._last_token_ns = sampled_ns
            text = text_stream.feed(piece)
            if text:
                if stream:
                    protocol.encode_line_into(TokenReply(id=self.request_id, text=text), batch)
                else:
                    self._parts.append(text)
            if text_stream.stop_hit is not None:
                # Reply now; the decode thread notices within one token and frees the slot.
                job.stop_requested = True
                pieces.clear()
                self._write(batch)
                self._reply_done("stop_sequence")
                return
        self._write(batch)

    def _finished(self) -> None:
        # The slot is released whatever happens here: a bug in writing the last
        # lines must never leave the slot busy for ever.
        try:
            self._drain()
            job = self.job
            if not self.replied:
                if job.end_reason == "error":
                    self._fail_with(job.error)
                else:
                    tail = self._text.finish()
                    if tail:
                        if self.stream:
                            self._write(protocol.encode_line(
                                TokenReply(id=self.request_id, text=tail)))
                        else:
                            self._parts.append(tail)
                    # end_reason is "stop", "length" or "cancelled" here ("error" is above).
                    self._reply_done("stop_sequence" if self._text.stop_hit is not None
                                     else cast(FinishReason, job.end_reason))
        except Exception:
            log.exception("finishing generation %r failed", self.request_id)
            self.fail(protocol.INTERNAL, "unexpected error in the daemon; see its log")
        finally:
            if self._scheduler is not None:
                self._scheduler._released(self)

    def _fail_with(self, error: BaseException | None) -> None:
        if isinstance(error, GrammarDeadEnd):
            # The request's own grammar, not a fault of the daemon: no traceback.
            log.info("generation %r: %s", self.request_id, error)
            if error.at_start:
                field = self.job.grammar.field if self.job.grammar is not None else "grammar"
                self.fail(protocol.INVALID_REQUEST, f"{error} - at `$.{field}`")
            else:
                self.fail(protocol.GRAMMAR_DEAD_END,
                          f"{error} after {self.completion_tokens} tokens; the text so far "
                          "was streamed")
            return
        log.error("generation %r failed", self.request_id, exc_info=error)
        self.fail(protocol.INTERNAL, "the model failed while generating; see the daemon log")

    def _write(self, data: bytes | bytearray) -> None:
        if data:
            self.sink.write(data)

    def _record(self, outcome: str) -> None:
        job = self.job
        self._stats.generation_ended(outcome, len(job.prompt), job.n_cached,
                                     self.completion_tokens, self._decode_ns())
        if job.grammar is not None:
            self._stats.grammar_requests += 1
            self._stats.grammar_tokens += job.grammar.tokens
            self._stats.grammar_resampled += job.grammar.resampled
            self._stats.grammar_closed_early += self._truncated
        self._stats.cache_hit(job.cache_source, job.n_cached)
        if job.restore_failed:
            log.warning("generation %r: llama.cpp refused a stored prompt state; "
                        "its prompt was evaluated instead", self.request_id)
        for what, error in job.contained:
            log.warning("generation %r: %s failed (%s); the request went on without it",
                        self.request_id, what, error, exc_info=error)
        if job.drafted:
            self._stats.speculative_requests += 1
            self._stats.drafted_tokens += job.drafted
            self._stats.accepted_tokens += job.accepted
            self._stats.draft_steps += job.draft_steps
            self._stats.aligned_steps += job.aligned_steps
            self._stats.logit_rows += job.logit_rows

    @property
    def _truncated(self) -> bool:
        """Closed early to fit max_tokens, and the reply is that whole document."""
        grammar = self.job.grammar
        return (grammar is not None and grammar.closed_early and self.job.end_reason == "stop"
                and self._text.stop_hit is None)

    def _decode_ns(self) -> int:
        return self._last_token_ns - self.job.t_first if self.completion_tokens > 1 else 0

    def _reply_done(self, reason: FinishReason) -> None:
        if self.replied:
            # A line written just before (the text up to a stop sequence, the held-back
            # tail) dropped the connection, and that counted the request as cancelled.
            return
        self.replied = True
        self._record(reason)
        self.sink.write(protocol.encode_line(DoneReply(
            id=self.request_id,
            text="" if self.stream else "".join(self._parts),
            finish_reason=reason,
            stop_sequence=self._text.stop_hit,
            truncated=self._truncated,
            usage=Usage(
                prompt_tokens=len(self.job.prompt),
                cached_tokens=self.job.n_cached,
                completion_tokens=self.completion_tokens,
                drafted_tokens=self.job.drafted,
                accepted_tokens=self.job.accepted,
            ),
            timings=self._timings(),
        )))
        self.sink.close()

    def _timings(self) -> Timings:
        job, now = self.job, time.perf_counter_ns()
        started = job.t_start or now
        prompt_ns = job.t_prompt_done - job.t_start if job.t_prompt_done else 0
        evaluated = len(job.prompt) - job.n_cached
        decode_ns = self._decode_ns()
        return Timings(
            queued_ms=_ms(started - self.arrived_ns),
            prompt_ms=_ms(prompt_ns),
            prompt_tok_s=_rate(evaluated, prompt_ns),
            first_token_ms=_ms(job.t_first - self.arrived_ns) if job.t_first else 0.0,
            decode_ms=_ms(decode_ns),
            decode_tok_s=_rate(self.completion_tokens - 1, decode_ns),
            total_ms=_ms(now - self.arrived_ns),
            cache_source=job.cache_source,
        )


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)


def _rate(count: int, ns: int) -> float:
    return round(count * 1e9 / ns, 2) if ns > 0 and count > 0 else 0.0


class Scheduler:
    """One FIFO in front of `slots` decode slots sharing one KV pool. Event loop only.

    The head of the queue starts as soon as a slot is free and the KV pool can hold
    everything it may come to need (its prompt plus max_tokens) beside what running
    requests may need; idle slots' cached prefixes are dropped, least recently used
    first, to make that room. So a running request never fails for lack of cells,
    and a waiting one only waits. Strict FIFO: nothing overtakes the head.
    """

    def __init__(self, engine: Engine, max_queue: int, slots: int = 1) -> None:
        self._engine = engine
        self._max_queue = max_queue
        self.slots = slots
        self.waiting: deque[Generation] = deque()
        self.running: dict[int, Generation] = {}
        # What each idle slot holds in the KV cache, as the decode thread left it.
        self._slot_tokens: list[list[int]] = [[] for _ in range(slots)]
        self._slot_used: list[int] = [0] * slots
        self._uses = 0
        self.slot_requests: list[int] = [0] * slots  # per-slot use, for `stats`
        self._exclusive = False  # a running request must have the batch to itself
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        return bool(self.running)

    @property
    def busy_slots(self) -> int:
        return len(self.running)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def submit(self, generation: Generation) -> None:
        if not self.waiting and self._try_start(generation):
            return
        if len(self.waiting) >= self._max_queue:
            raise QueueFull
        self.waiting.append(generation)
        self._pump()  # it may fit where the head waiting for room does not

    def abandon(self, generation: Generation) -> None:
        """The client went away: drop it from the queue, or stop it within one token."""
        generation.abandon()
        if not self._is_running(generation):
            with contextlib.suppress(ValueError):  # already dispatched or answered
                self.waiting.remove(generation)
                self._pump()  # it may have been the head that held the others back

    def cancel(self, generation: Generation) -> None:
        """The cancel op: a queued request is answered at once, a running one stops
        within one token (or one prompt batch)."""
        if self._is_running(generation):
            generation.cancel()
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(generation)
        generation.cancel_queued()
        self._pump()

    def reject_waiting(self, code: str, message: str) -> None:
        while self.waiting:
            self.waiting.popleft().fail(code, message)

    def fail_all(self, code: str, message: str) -> None:
        """The decode thread is gone: every request, running or waiting, is answered
        with an error now (no running one will ever finish) and the slots are free."""
        running = list(self.running.values())
        self.running.clear()
        for generation in running:
            generation.fail(code, message)
        self.reject_waiting(code, message)
        self._idle.set()

    def cancel_running(self) -> None:
        for generation in list(self.running.values()):
            generation.cancel()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def slot_uses(self) -> list[SlotUse]:
        return [SlotUse(slot=slot, busy=slot in self.running,
                        requests=self.slot_requests[slot],
                        cached_tokens=0 if slot in self.running else len(self._slot_tokens[slot]))
                for slot in range(self.slots)]

    def _is_running(self, generation: Generation) -> bool:
        return self.running.get(generation.job.slot) is generation

    def _try_start(self, generation: Generation) -> bool:
        job = generation.job
        if self.running and (job.exclusive or self._exclusive):
            return False
        free = [slot for slot in range(self.slots) if slot not in self.running]
        if not free:
            return False
        slot = self._pick_slot(free, job.prompt)
        pool = self._engine.n_ctx
        held = sum(g.job.reserved_cells for g in self.running.values())
        held += job.reserved_cells
        idle = sorted((s for s in free if s != slot and self._slot_tokens[s]),
                      key=self._slot_used.__getitem__)
        held += sum(len(self._slot_tokens[s]) for s in idle)
        evict = []
        for other in idle:
            if held <= pool and not job.exclusive:
                break
            # An exclusive request empties every other slot: where llama.cpp places a
            # sequence's cells, among other sequences' cells, changes the order its
            # attention sums in, so only an otherwise empty cache gives cold-run bytes.
            evict.append(other)
            held -= len(self._slot_tokens[other])
        if held > pool:
            return False
        for other in evict:
            self._slot_tokens[other] = []
        job.slot = slot
        job.evict = tuple(evict)
        self.running[slot] = generation
        self._exclusive = job.exclusive
        self.slot_requests[slot] += 1
        self._idle.clear()
        generation._scheduler = self
        self._engine.submit(job)
        return True

    def _pick_slot(self, free: list[int], prompt: list[int]) -> int:
        """The free slot whose cache shares the longest worthwhile prefix with `prompt`,
        else the least recently used one (an unused one first).

        A shared prefix is worthwhile when it is most of what the slot holds, or long
        in itself (a common system prompt): a lone BOS in common is not worth
        overwriting another conversation's cache for.
        """
        best, best_shared = -1, 0
        for slot in free:
            cached = self._slot_tokens[slot]
            shared = shared_prefix(cached, prompt)
            worthwhile = shared * 2 > len(cached) or shared >= _WORTHWHILE_PREFIX
            if worthwhile and shared > best_shared:
                best, best_shared = slot, shared
        if best >= 0:
            return best
        return min(free, key=self._slot_used.__getitem__)

    def _released(self, generation: Generation) -> None:
        slot = generation.job.slot
        if self.running.get(slot) is not generation:
            return
        del self.running[slot]
        self._exclusive = False
        self._slot_tokens[slot] = generation.job.kept
        self._uses += 1
        self._slot_used[slot] = self._uses
        self._pump()

    def _pump(self) -> None:
        waiting = self.waiting
        while waiting:
            head = waiting[0]
            if head.replied:
                waiting.popleft()
                continue
            if not self._try_start(head):
                break
            waiting.popleft()
        if waiting:
            self._overtake(waiting[0])
        if not self.running and not waiting:
            self._idle.set()

    def _overtake(self, head: Generation) -> None:
        """The head waits for room in the KV pool (a large reservation) or for the batch
        to empty: later requests that fit now start first, at most _MAX_OVERTAKES times
        in all, so one large request neither holds up the small ones nor waits forever."""
        for generation in list(self.waiting)[1:]:
            if head.overtaken >= _MAX_OVERTAKES or len(self.running) >= self.slots:
                return
            if generation.replied or generation.job.exclusive:
                continue
            if self._try_start(generation):
                self.waiting.remove(generation)
                head.overtaken += 1

