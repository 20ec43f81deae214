"""The wait queue's order by priority, and the positions it tells the waiting (issue 64).

The real `Scheduler` and `Generation`s over a fake engine that only records what it is
handed: no model, no decode thread. A job "ends" when the test releases its slot, as
the decode thread's end record would.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from sfcore_daemon.core.generation import Generation
from sfcore_daemon.core.request import Priority
from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.core.waitqueue import MAX_PASSES
from sfcore_daemon.engine.crossing import JobSpec
from sfcore_daemon.llama.sampling import Sampling

pytestmark = pytest.mark.asyncio


@dataclass
class _Engine:
    """What the scheduler asks of the engine: the pool's size, and jobs to run."""

    n_ctx: int = 4096
    n_ubatch: int = 512
    store: Any = None
    started: list[JobSpec] = field(default_factory=list)

    def submit(self, job: JobSpec, *_args: Any) -> None:
        self.started.append(job)


@dataclass
class _Sink:
    """A reply sink that records the positions it is told."""

    positions: list[tuple[int, int]] = field(default_factory=list)
    on_queued: Any = None

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> None: ...

    def flush(self) -> None: ...

    def queued(self, position: int, depth: int) -> None:
        self.positions.append((position, depth))
        if self.on_queued is not None:
            self.on_queued()

    def done(self, reply: Result) -> None: ...

    def error(self, code: str, message: str) -> None: ...

    def close(self) -> None: ...


class _Queue:
    def __init__(self, slots: int = 1, n_ctx: int = 4096) -> None:
        self.engine = _Engine(n_ctx)
        self.scheduler = Scheduler(self.engine, max_queue=64, slots=slots)  # type: ignore[arg-type]
        self.stats = Stats()
        self.names: dict[int, str] = {}

    def submit(self, name: str, priority: Priority = "interactive", *, stream: bool = True,
               max_tokens: int = 8) -> Generation:
        generation = Generation(
            request_id=name, stream=stream, stops=(), prompt=[2, 100, 101],
            max_tokens=max_tokens,
            sampling=Sampling(temperature=0.0, top_k=40, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, seed=None),
            cache_prompt=True, sink=_Sink(), arrived_ns=0,
            loop=asyncio.get_running_loop(), stats=self.stats, priority=priority)
        self.names[id(generation.job)] = name
        self.scheduler.submit(generation)
        return generation

    @property
    def started(self) -> list[str]:
        return [self.names[id(job)] for job in self.engine.started]

    def end(self, generation: Generation) -> None:
        """Its job has ended: the slot is free for the next."""
        self.scheduler.release(generation)


def positions(generation: Generation) -> list[tuple[int, int]]:
    sink = generation.sink
    assert isinstance(sink, _Sink)
    return sink.positions


async def test_interactive_requests_start_before_background_ones_fifo_within_each() -> None:
    queue = _Queue()
    runner = queue.submit("runner", "background")
    waiting = [queue.submit("b1", "background"), queue.submit("i1"),
               queue.submit("b2", "background"), queue.submit("i2")]
    assert [g.request_id for g in queue.scheduler.waiting] == ["i1", "i2", "b1", "b2"]
    queue.end(runner)
    by_name = {g.request_id: g for g in waiting}
    for name in ("i1", "i2", "b1", "b2"):
        assert queue.started[-1] == name
        queue.end(by_name[name])
    assert queue.started == ["runner", "i1", "i2", "b1", "b2"]
    assert not queue.scheduler.waiting and not queue.scheduler.busy
    # The engine is handed each job's class (its step batch may use it).
    assert [g.job.priority for g in waiting] == [
        "background", "interactive", "background", "interactive"]


async def test_a_background_request_passed_too_often_is_passed_no_more() -> None:
    queue = _Queue()
    running = queue.submit("runner")
    queue.submit("late", "background")
    # Interactive requests keep arriving, one more than finishes each time: without the
    # bound the background one would wait for ever.
    queue.submit("i0")
    for number in range(1, MAX_PASSES + 2):
        queue.submit(f"i{number}")
        queue.end(running)
        running = queue.scheduler.running[0]
        if number <= MAX_PASSES:
            assert running.request_id == f"i{number - 1}", queue.started
    # Passed MAX_PASSES times by requests that came after it: it goes next, ahead of the
    # interactive requests still waiting, which then follow in their order.
    assert running.request_id == "late", queue.started
    assert [g.request_id for g in queue.scheduler.waiting] == [
        f"i{MAX_PASSES}", f"i{MAX_PASSES + 1}"]


async def test_interactive_requests_that_came_first_do_not_pass() -> None:
    queue = _Queue()
    runner = queue.submit("runner")
    earlier = [queue.submit(f"i{number}") for number in range(MAX_PASSES + 2)]
    late = queue.submit("late", "background")
    for generation in [runner, *earlier]:
        queue.end(generation)
    assert queue.started == ["runner", *(g.request_id for g in earlier), "late"]
    assert late.placement is not None


async def test_a_streamed_request_is_told_its_position_as_it_changes() -> None:
    queue = _Queue()
    runner = queue.submit("runner")
    background = queue.submit("b", "background")
    quiet = queue.submit("quiet", "background", stream=False)
    assert positions(runner) == []  # started at once: it never waited
    # A request behind it deepens the queue but leaves its position: nothing is said.
    assert positions(background) == [(1, 1)]
    first = queue.submit("i1")
    assert positions(first) == [(1, 3)]
    assert positions(background) == [(1, 1), (2, 3)]  # passed in the queue
    second = queue.submit("i2")
    assert positions(second) == [(2, 4)]
    assert positions(background) == [(1, 1), (2, 3), (3, 4)]
    queue.end(runner)  # i1 starts: everyone behind it moves up
    assert positions(second)[-1] == (1, 3) and positions(background)[-1] == (2, 3)
    queue.scheduler.cancel(second)
    assert positions(background)[-1] == (1, 2)
    # Said only when it changes, never for a reply written whole.
    assert positions(background) == [(1, 1), (2, 3), (3, 4), (2, 3), (1, 2)]
    assert positions(quiet) == []
    assert positions(first) == [(1, 3)]


async def test_a_sink_whose_client_leaves_while_told_leaves_the_queue_consistent() -> None:
    queue = _Queue()
    runner = queue.submit("runner")
    stays = queue.submit("stays")
    leaving = queue.submit("leaving", "background")
    behind = queue.submit("behind", "background")
    sink = leaving.sink
    assert isinstance(sink, _Sink)
    # Told its new position, its client turns out gone: abandoned from inside the telling.
    sink.on_queued = lambda: queue.scheduler.abandon(leaving)
    queue.scheduler.cancel(stays)
    assert leaving.replied and leaving.placement is None
    assert [g.request_id for g in queue.scheduler.waiting] == ["behind"]
    assert positions(behind)[-1] == (1, 1)
    queue.end(runner)
    assert queue.started == ["runner", "behind"]


async def test_a_head_that_cannot_fit_is_still_overtaken_a_bounded_number_of_times() -> None:
    # A pool of 64 cells: the runner holds 3 + 30, a large head asks for 3 + 40 and
    # waits; small requests behind it fit beside the runner and start first.
    queue = _Queue(slots=3, n_ctx=64)
    queue.submit("runner", max_tokens=30)
    large = queue.submit("large", max_tokens=40)
    for number in range(10):
        small = queue.submit(f"s{number}", "background", max_tokens=2)
        if small.placement is not None:
            queue.end(small)
    assert queue.started == ["runner", *(f"s{number}" for number in range(8))]
    assert large.overtaken == 8 and large.placement is None
    assert [g.request_id for g in queue.scheduler.waiting] == ["large", "s8", "s9"]
