"""systemd watchdog: pings while healthy, none while the decode thread is stuck.

The unit tests drive the stall logic with a fake clock; the end-to-end tests run
the real daemon with WATCHDOG_USEC=1 s (pings every 0.5 s) and read its sd_notify
datagrams on the harness's NOTIFY_SOCKET.

This file holds the tests that need no daemon and no model; those of the daemon's
process (start-up, exit) in tests/lifecycle/test_watchdog.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import pytest

from sfcore_daemon.system.watchdog import StallDetector, Watchdog
from tests.kit import REPO


def test_stall_needs_no_progress_for_longer_than_the_limit_while_busy() -> None:
    detector = StallDetector(limit_s=1.0)
    assert not detector.stalled(5, busy=True, now=0.0)
    assert not detector.stalled(5, busy=True, now=0.9)
    assert not detector.stalled(5, busy=True, now=1.0)  # exactly the limit is not longer
    assert detector.stalled(5, busy=True, now=1.1)
    assert detector.stalled_for(1.1) == pytest.approx(1.1)
    assert not detector.stalled(6, busy=True, now=1.2)  # progress again
    assert not detector.stalled(6, busy=False, now=9.0)  # idle is never a stall
    assert not detector.stalled(6, busy=True, now=9.5)  # the clock starts when work starts
    assert detector.stalled(6, busy=True, now=10.6)


def test_idle_time_before_a_request_does_not_count() -> None:
    detector = StallDetector(limit_s=1.0)
    for now in range(100):  # a long idle spell, counter unchanged
        assert not detector.stalled(3, busy=False, now=float(now))
    assert not detector.stalled(3, busy=True, now=100.5)  # a request starts
    assert not detector.stalled(3, busy=True, now=101.0)
    assert detector.stalled(3, busy=True, now=101.6)


class FakeDecodeThread:
    def __init__(self) -> None:
        self.progress = 0
        self.busy = False
        self.pings: list[float] = []
        self.now = 0.0

    def watchdog(self, interval_s: float = 1.0) -> Watchdog:
        def notify(state: str) -> bool:
            assert state == "WATCHDOG=1"
            self.pings.append(self.now)
            return True

        return Watchdog(interval_s, progress=lambda: self.progress, busy=lambda: self.busy,
                        notify=notify)

    def run_for(self, watchdog: Watchdog, seconds: float, *, bump: bool) -> None:
        """Tick every half interval for `seconds`, bumping progress first if `bump`."""
        end = self.now + seconds
        while self.now < end:
            if bump:
                self.progress += 1
            watchdog.tick(self.now)
            self.now += watchdog.interval_s / 2


def test_pings_stop_once_while_stuck_and_resume_with_progress(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sfcore_daemon.system.watchdog")
    thread = FakeDecodeThread()
    watchdog = thread.watchdog(interval_s=1.0)

    thread.run_for(watchdog, 5.0, bump=False)  # idle: every tick pings
    assert len(thread.pings) == 10
    thread.busy = True
    thread.run_for(watchdog, 5.0, bump=True)  # generating: every tick pings
    assert len(thread.pings) == 20
    assert not caplog.records

    stall_start = thread.now
    thread.run_for(watchdog, 10.0, bump=False)  # stuck for 10 s
    pings_while_stuck = [t for t in thread.pings if t >= stall_start]
    # The counter last moved at the tick before stall_start: the ticks 0.5 s and
    # 1.0 s after that still ping, the one 1.5 s after it (> the 1 s interval) not.
    assert pings_while_stuck == [stall_start, stall_start + 0.5]
    assert watchdog.stuck
    stopped = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(stopped) == 1, caplog.records  # logged once, not on every tick
    assert "no progress for 1.5 s" in stopped[0].getMessage()

    resumed_at = thread.now
    thread.run_for(watchdog, 2.0, bump=True)
    assert thread.pings[-4:] == [resumed_at, resumed_at + 0.5, resumed_at + 1.0, resumed_at + 1.5]
    assert not watchdog.stuck
    resumed = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(resumed) == 1 and "progress again" in resumed[0].getMessage()
    assert len(caplog.records) == 2


def test_a_stuck_thread_that_goes_idle_pings_again() -> None:
    # e.g. the stuck request was finally cancelled and nothing else is queued
    thread = FakeDecodeThread()
    watchdog = thread.watchdog()
    thread.busy = True
    thread.run_for(watchdog, 3.0, bump=False)
    assert watchdog.stuck
    count = len(thread.pings)
    thread.busy = False
    thread.run_for(watchdog, 1.0, bump=False)
    assert len(thread.pings) == count + 2 and not watchdog.stuck


@pytest.mark.parametrize(("env", "interval"), [
    ({}, None),
    ({"WATCHDOG_USEC": "30000000"}, 30.0),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "{pid}"}, 1.0),
    ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "-5"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_PID": "{pid}"}, None),
])
def test_from_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                  interval: float | None) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(pid=os.getpid()))
    watchdog = Watchdog.from_env(progress=lambda: 0, busy=lambda: False)
    if interval is None:
        assert watchdog is None
    else:
        assert watchdog is not None and watchdog.interval_s == interval


@pytest.mark.asyncio
async def test_run_pings_on_the_event_loop_until_cancelled() -> None:
    pinged = asyncio.Event()
    pings: list[float] = []

    def notify(state: str) -> bool:
        pings.append(time.monotonic())
        if len(pings) == 3:
            pinged.set()
        return True

    watchdog = Watchdog(0.1, progress=lambda: 0, busy=lambda: False, notify=notify)
    task = asyncio.ensure_future(watchdog.run())
    await asyncio.wait_for(pinged.wait(), 10.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pings[2] - pings[0] >= 0.09  # paced at half the interval (0.05 s), not a busy loop
    count = len(pings)
    await asyncio.sleep(0.2)
    assert len(pings) == count  # no pings after cancel


def test_the_unit_asks_for_the_watchdog_and_thread_dumps() -> None:
    unit = (REPO / "systemd" / "sfcore-ai.service").read_text()
    lines = {line.strip() for line in unit.splitlines() if not line.startswith("#")}
    assert "WatchdogSec=30s" in lines
    assert "NotifyAccess=main" in lines
    assert "Environment=PYTHONFAULTHANDLER=1" in lines
