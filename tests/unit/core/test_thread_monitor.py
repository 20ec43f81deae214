"""The adaptive threads' loop side (core/threads.py): when it reads the others' load. The
policy's own logic is tests/unit/engine/test_threadpolicy.py, the whole path against the
real daemon tests/e2e/ndjson/test_adaptive_threads.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sfcore_daemon.core import threads
from sfcore_daemon.engine.threadpolicy import ThreadLimits, ThreadPolicy

pytest_asyncio_mark = pytest.mark.asyncio(loop_scope="function")


class OneGeneration:
    """A scheduler that is busy once: `wait_busy` returns at once the first time (the
    generation starts), then never again; `busy` from then on."""

    def __init__(self, events: list[str]) -> None:
        self._events = events
        self.busy = False
        self._started = False
        self._never = asyncio.Event()

    async def wait_busy(self) -> None:
        if self._started:
            await self._never.wait()
        self._started = self.busy = True
        self._events.append("busy")


@pytest_asyncio_mark
async def test_no_load_reading_lands_on_a_generations_first_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A reading at the busy edge ran beside the new generation's first step and cost a
    # short prompt's first token ~10 ms (docs/performance/sharing-the-machine.md).
    events: list[str] = []
    policy = ThreadPolicy(ThreadLimits(2, 2, 2), adaptive=True)
    policy.others_cpus = 1.5  # the last generation's figure
    read = asyncio.Event()

    class Load:
        def __init__(self, cpus: list[int]) -> None:
            self.calls = 0

        def sample(self) -> float:
            self.calls += 1
            events.append(f"sample with {policy.others_cpus}")
            if self.calls == 2:
                read.set()
            return 0.25

    monkeypatch.setattr(threads, "OtherLoad", Load)
    monkeypatch.setattr(threads, "SAMPLE_S", 0.0)
    scheduler = OneGeneration(events)
    monitor = asyncio.ensure_future(
        threads.ThreadMonitor(policy, scheduler, [0, 1]).run())  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(read.wait(), 10)
    finally:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
    # Start-up's reading, then the busy edge with nothing read and the stale figure
    # dropped, then the first reading one SAMPLE_S into the generation.
    assert events[:3] == ["sample with 1.5", "busy", "sample with None"], events
    assert policy.others_cpus == 0.25
