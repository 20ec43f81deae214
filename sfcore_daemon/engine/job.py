"""A generation as the decode thread sees it, shared with the event loop."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from sfcore_daemon.llama.logprobs import TokenLogprobs
from sfcore_daemon.llama.sampling import Sampling

if TYPE_CHECKING:
    import asyncio

    from sfcore_daemon.structured.grammar import GrammarSampler

EndReason = Literal["stop", "length", "cancelled", "error"]
CacheSource = Literal["none", "slot", "ram", "disk"]


class Job:
    """One generation, shared between the event loop and the decode thread.

    The loop writes only `stop_requested`; the thread writes everything else and
    announces new pieces through `wake`, which the loop answers with `drain`.
    """

    __slots__ = (
        "prompt", "sampling", "max_tokens", "cache_prompt", "stop_requested",
        "pieces", "wake_pending", "wake_each_step", "_wake", "_finished", "loop",
        "n_cached", "t_start", "t_prompt_done", "t_first", "end_reason", "error",
        "slot", "evict", "exclusive", "kept", "grammar", "speculative", "drafted",
        "accepted", "draft_steps", "aligned_steps", "logit_rows", "cache_source", "restore_failed",
        "contained", "logprobs", "numbers", "grammar_trigger", "grammar_live", "trigger_tail",
        "forced_drafted", "forced_accepted",
    )

    def __init__(
        self,
        prompt: list[int],
        sampling: Sampling,
        max_tokens: int,
        cache_prompt: bool,
        *,
        loop: asyncio.AbstractEventLoop,
        on_pieces: Callable[[], None],
        on_finished: Callable[[], None],
        grammar: GrammarSampler | None = None,
        speculative: bool = False,
        logprobs: int | None = None,
        grammar_trigger: bytes | None = None,
    ) -> None:
        self.prompt = prompt
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.cache_prompt = cache_prompt
        self.stop_requested = False
        # (token bytes, perf_counter_ns at sampling); appended by the thread only.
        self.pieces: deque[tuple[bytes, int]] = deque()
        # The alternatives a request's `logprobs` asks for per token (0: the token's own
        # logprob only), None when it asks for none. Then the thread appends each
        # token's numbers (llama/logprobs.py) here as it is drawn, before its piece: the
        # n-th piece's numbers are the n-th entry (tokens drawn but never emitted, the
        # end-of-generation one or draft rows past the end, leave more at the end).
        self.logprobs = logprobs
        self.numbers: deque[TokenLogprobs] = deque()
        self.wake_pending = False
        # Whether the loop needs its pieces as they come (a stream, stop sequences to
        # watch for). Otherwise they wait for the end: no wake-up of the event loop per
        # step, whose thread would take a core from llama.cpp's on a 2-core machine.
        self.wake_each_step = True
        self.loop = loop
        self._wake = on_pieces
        self._finished = on_finished
        self.n_cached = 0
        # Where the n_cached rows came from: a slot's cells, or a stored state
        # restored from the RAM or the disk tier (promptstore.py).
        self.cache_source: CacheSource = "none"
        # A stored state llama.cpp refused: the prompt was evaluated (the loop logs it).
        self.restore_failed = False
        # Failures the decode thread contained while serving this job (the prompt store,
        # the drafter, ending it): each skipped its part and the job went on. (what
        # failed, the exception), for the loop to log.
        self.contained: list[tuple[str, BaseException]] = []
        self.t_start = 0
        self.t_prompt_done = 0
        self.t_first = 0
        self.end_reason: EndReason = "error"
        self.error: BaseException | None = None
        # Owned by the job: the decode thread frees it when the job ends; one that never
        # reaches the decode thread frees itself when collected.
        self.grammar = grammar
        # With a trigger, the grammar holds the output only once the output ends with
        # it (an "auto" tool call's marker); before, the job samples as without one.
        # The tail of the output the decode thread watches for it.
        self.grammar_trigger = grammar_trigger
        self.grammar_live = grammar is not None and grammar_trigger is None
        self.trigger_tail = b""
        # Whether the decode thread may draft tokens for this job (speculative.py), and
        # how many it drafted and how many of those were accepted; the steps that
        # verified its drafts, of those the steps whose logit rows were a multiple of
        # [speculative] row_multiple, and those steps' logit rows, all counted from the
        # batch as submitted (thread-written).
        self.speculative = speculative
        self.drafted = 0
        self.accepted = 0
        # Of drafted and accepted: the tokens a schema's grammar forced (forced.py).
        self.forced_drafted = 0
        self.forced_accepted = 0
        self.draft_steps = 0
        self.aligned_steps = 0
        self.logit_rows = 0
        # Set by the scheduler before submit: the sequence (slot) to run on, the idle
        # slots whose cached tokens must be dropped first to make room, and whether
        # the job must have the batch to itself (reproducible results).
        self.slot = 0
        self.evict: tuple[int, ...] = ()
        self.exclusive = False
        # Written by the decode thread as the job ends: the tokens its slot now holds.
        self.kept: list[int] = []

    @property
    def reserved_cells(self) -> int:
        """KV cells this job can come to hold: its prompt plus every token it may add."""
        return len(self.prompt) + self.max_tokens
