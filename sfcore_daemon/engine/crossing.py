"""The one crossing between the event loop and the decode thread.

Everything else has one owner. What a request fixes is frozen before the decode
thread sees it (`JobSpec`, `Placement`); what the decode thread learns comes back
through the job's `Channel` only: its pieces and logprob numbers as they are drawn,
then one frozen `JobEnd`. The loop's only way back in is the engine's inbox (new
jobs) and `Channel.stop`.

    event loop                                   decode thread
    ----------                                   -------------
    JobSpec, Placement  ── Engine.submit ──────► inbox, then its own Job (job.py)
    Channel.stop()      ── stopped (a flag) ───► read each step and by the abort callback
    on_pieces()  ◄── call_soon_threadsafe ────── Channel.put, at most once per step (wake)
    on_end(JobEnd) ◄── call_soon_threadsafe ──── Channel.end, once per job

With SFCORE_CHECK_THREADS=1 in the environment at start-up (the tests' harness sets
it), each side's methods assert that they run on their side's thread.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import msgspec

from sfcore_daemon.llama.logprobs import TokenLogprobs
from sfcore_daemon.llama.sampling import Sampling

if TYPE_CHECKING:
    import asyncio

    from sfcore_daemon.structured.grammar import GrammarSampler

EndReason = Literal["stop", "length", "cancelled", "error"]
CacheSource = Literal["none", "slot", "ram", "disk"]

# Read once: off, the methods below are the plain ones (no cost per token).
CHECK_THREADS = os.environ.get("SFCORE_CHECK_THREADS", "") not in ("", "0")

_F = TypeVar("_F", bound=Callable[..., Any])


class JobSpec(msgspec.Struct, frozen=True):
    """What a request fixes when admission makes it; frozen (a write raises).

    `prompt` is never changed by anyone. `grammar` is the decode thread's from submit
    on (it draws with it and frees it as the job ends); a spec never submitted leaves
    it to free itself when collected. With a `grammar_trigger` the grammar holds the
    output only once the output ends with it (an "auto" tool call). `logprobs`: the
    alternatives asked for per token (0: the token's own only), None for none.
    `wake_each_step`: whether the loop needs the pieces as they come (a stream, stop
    sequences to watch for); otherwise they wait for the end, and no step wakes the
    event loop, whose thread would take a core from llama.cpp's on a 2-core machine.
    `pins`: (n, seconds) for each cache mark: the state of the prompt's first n tokens
    is kept pinned in the prompt store that long (storepolicy.PromptStates.pin)."""

    prompt: list[int]
    sampling: Sampling
    max_tokens: int
    cache_prompt: bool
    grammar: GrammarSampler | None = None
    speculative: bool = False
    logprobs: int | None = None
    grammar_trigger: bytes | None = None
    wake_each_step: bool = True
    pins: tuple[tuple[int, int], ...] = ()
    priority: str = "interactive"

    @property
    def reserved_cells(self) -> int:
        """KV cells this job can come to hold: its prompt plus every token it may add."""
        return len(self.prompt) + self.max_tokens


class Placement(NamedTuple):
    """Where the scheduler runs a job, fixed before submit: the sequence (slot), and
    the idle slots whose cached tokens must be dropped first to make room."""

    slot: int
    evict: tuple[int, ...] = ()


class JobEnd(msgspec.Struct, frozen=True):
    """How a job ended, sent once by the decode thread as its last word.

    `n_cached` prompt tokens came from `cache_source` (a slot's cells, a stored state
    from RAM or disk); `restore_failed`: llama.cpp refused a stored state and the
    prompt was evaluated. Times are perf_counter_ns (0: not reached). The draft counts
    are speculative.py's (forced_*: a schema's forced text, of those). `kept`: the
    tokens the slot now holds (the loop's from here on). `contained`: failures the
    decode thread contained while serving the job (what, the exception), and
    `notices` what else it has to say, for the loop to log. `pinned`: the longest
    prefix of the spec's `pins` whose state this job stored (0: none)."""

    end_reason: EndReason
    error: BaseException | None = None
    n_cached: int = 0
    cache_source: CacheSource = "none"
    restore_failed: bool = False
    t_start: int = 0
    t_prompt_done: int = 0
    t_first: int = 0
    drafted: int = 0
    accepted: int = 0
    forced_drafted: int = 0
    forced_accepted: int = 0
    draft_steps: int = 0
    aligned_steps: int = 0
    logit_rows: int = 0
    grammar_tokens: int = 0
    grammar_resampled: int = 0
    closed_early: bool = False
    kept: list[int] = []
    contained: tuple[tuple[str, BaseException], ...] = ()
    notices: tuple[str, ...] = ()
    pinned: int = 0


# What the loop accounts a job by when it never ran (answered while queued).
NOT_RUN = JobEnd("cancelled")


def _on_decode_side(method: _F) -> _F:
    """`method`, asserting it does not run on the loop's thread (checks on)."""
    def checked(self: Channel, *args: Any) -> Any:
        assert threading.get_ident() != self._loop_thread, \
            f"Channel.{method.__name__} is the decode thread's, called on the event loop"
        return method(self, *args)
    return checked  # type: ignore[return-value]


def _on_loop_side(method: _F) -> _F:
    """`method`, asserting it runs on the loop's thread (checks on)."""
    def checked(self: Channel, *args: Any) -> Any:
        assert threading.get_ident() == self._loop_thread, \
            f"Channel.{method.__name__} is the event loop's, called on another thread"
        return method(self, *args)
    return checked  # type: ignore[return-value]


class Channel:
    """One job's way back from the decode thread to the event loop, and its stop flag.

    The only object both threads write. Decode side: `put`, `put_numbers`, `end`
    (and `wake`, for a step's woken channels). Loop side: `stop`, and reading
    `pieces` and `numbers` when told to (`on_pieces`, `on_end`)."""

    __slots__ = ("pieces", "numbers", "stopped", "_wake_pending", "_wake_each_step", "_loop",
                 "_on_pieces", "_on_end", "_loop_thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_pieces: Callable[[], None],
                 on_end: Callable[[JobEnd], None], *, wake_each_step: bool = True) -> None:
        # (token bytes, perf_counter_ns at sampling): appended by the decode thread,
        # popped by the loop (a deque's append and popleft are atomic).
        self.pieces: deque[tuple[bytes, int]] = deque()
        # With logprobs: each token's numbers (llama/logprobs.py), appended before its piece,
        # so piece n's are entry n; tokens never emitted leave extra entries at the end.
        self.numbers: deque[TokenLogprobs] = deque()
        # The loop's only write: set once, never cleared; the decode thread ends the
        # job within a step (inside a long prompt batch, through the abort callback).
        self.stopped = False
        self._wake_pending = False
        self._wake_each_step = wake_each_step
        self._loop = loop
        self._on_pieces = on_pieces
        self._on_end = on_end
        self._loop_thread = threading.get_ident()  # made on the loop

    # --- the decode thread ----------------------------------------------------------

    def put(self, piece: bytes, now: int, woken: list[Channel]) -> None:
        """A token's piece; the channel joins `woken` (wake, once per step) unless a
        wake-up is on its way already or the loop wants the pieces at the end only.

        Why the flag is safe under the GIL without a lock: this thread sets it only
        after appending, and the loop (`_drain_each`) clears it before it drains. A
        piece appended before the clear is drained after it; one appended after sees
        the flag clear and schedules the next drain. So no piece waits unseen, and a
        flag read stale costs at most one drain that finds nothing."""
        self.pieces.append((piece, now))
        if self._wake_each_step and not self._wake_pending:
            self._wake_pending = True
            woken.append(self)

    def put_numbers(self, numbers: TokenLogprobs) -> None:
        """A drawn token's logprob numbers (the decode thread or a wide pass's)."""
        self.numbers.append(numbers)

    def end(self, record: JobEnd) -> None:
        """The job's last word: every piece is in, `on_end(record)` runs on the loop."""
        self._loop.call_soon_threadsafe(self._on_end, record)

    # --- the event loop -------------------------------------------------------------

    def stop(self) -> None:
        """End the job soon (cancel, abandon, a stop sequence, shutdown)."""
        self.stopped = True

    if CHECK_THREADS:
        put = _on_decode_side(put)
        put_numbers = _on_decode_side(put_numbers)
        end = _on_decode_side(end)
        stop = _on_loop_side(stop)


def wake(woken: list[Channel]) -> None:
    """One wake-up of the event loop for a step's woken channels, whatever their
    number (decode thread)."""
    if woken:
        woken[0]._loop.call_soon_threadsafe(_drain_each, woken)


def _drain_each(woken: list[Channel]) -> None:
    """On the loop: each woken channel's pieces to its generation."""
    for channel in woken:
        if CHECK_THREADS:
            assert threading.get_ident() == channel._loop_thread
        # Cleared before the drain reads, so a piece put meanwhile schedules another.
        channel._wake_pending = False
        channel._on_pieces()
