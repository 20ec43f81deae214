"""systemd watchdog: pings while healthy, none while the decode thread is stuck."""

from __future__ import annotations

import asyncio
import time

import pytest

from sfcore_daemon.watchdog import StallDetector
from tests.harness import running_daemon


def test_stall_needs_no_progress_for_longer_than_the_limit_while_busy() -> None:
    detector = StallDetector(limit_s=1.0)
    assert not detector.stalled(5, busy=True, now=0.0)
    assert not detector.stalled(5, busy=True, now=0.9)
    assert detector.stalled(5, busy=True, now=1.1)
    assert not detector.stalled(6, busy=True, now=1.2)  # progress again
    assert not detector.stalled(6, busy=False, now=9.0)  # idle is never a stall
    assert not detector.stalled(6, busy=True, now=9.5)
    assert detector.stalled(6, busy=True, now=10.6)


async def count_pings(daemon: object, seconds: float) -> int:
    pings = 0
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            await daemon.notification("WATCHDOG=1", timeout=remaining)  # type: ignore[attr-defined]
        except AssertionError:
            break  # no ping within the rest of the window
        pings += 1
    return pings


def drain_queued_notifications(daemon: object) -> None:
    sock = daemon._notify_sock  # type: ignore[attr-defined]
    while True:
        try:
            sock.recv(4096)
        except BlockingIOError:
            return


@pytest.mark.asyncio
async def test_pings_arrive_while_idle_and_while_generating() -> None:
    async with running_daemon(env={"WATCHDOG_USEC": "1000000"}) as daemon:
        assert await count_pings(daemon, 3.0) >= 4  # every 0.5 s; slack for a busy machine
        async with daemon.client() as client:
            await client.start_streaming({"prompt": "Tell a long story", "max_tokens": 400})
            assert await count_pings(daemon, 3.0) >= 4


@pytest.mark.asyncio
async def test_pings_stop_when_the_decode_thread_hangs_and_the_loop_still_answers() -> None:
    env = {"WATCHDOG_USEC": "1000000", "SFCORE_FAILPOINT": "decode_hang"}
    async with running_daemon(env=env, expect_clean_exit=False) as daemon:
        async with daemon.client() as client, daemon.client() as monitor:
            await client.send({"prompt": "Hi", "max_tokens": 4})
            await asyncio.sleep(1.5)  # the stall must outlast one interval; no event exists
            drain_queued_notifications(daemon)  # pings sent before the stall was noticed
            assert await count_pings(daemon, 3.0) == 0
            health = await monitor.final({"op": "health"})
            assert health["busy"] is True
        daemon.process.kill()
