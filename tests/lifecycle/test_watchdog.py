"""systemd watchdog: pings while healthy, none while the decode thread is stuck.

The unit tests drive the stall logic with a fake clock; the end-to-end tests run
the real daemon with WATCHDOG_USEC=1 s (pings every 0.5 s) and read its sd_notify
datagrams on the harness's NOTIFY_SOCKET.

This file holds the tests of the daemon's process (start-up, exit); those that need no
daemon and no model in tests/unit/system/test_watchdog.py.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.kit import Daemon, running_daemon

WATCHDOG_ENV = {"WATCHDOG_USEC": "1000000"}  # 1 s: a ping every 0.5 s
# One decode thread: with two OpenMP threads on a shared 2-CPU machine, one token can
# take over a second while another process holds a CPU (every graph barrier waits for
# the descheduled thread), and that is a real stall for a 1 s watchdog. (The unit's
# 30 s leaves room for it.)
ONE_THREAD = {"runtime": {"n_threads": 1, "n_threads_batch": 1}}


def drain_queued_notifications(daemon: Daemon) -> None:
    sock = daemon._notify_sock
    assert sock is not None
    while True:
        try:
            sock.recv(4096)
        except BlockingIOError:
            return


async def ping_times(daemon: Daemon, seconds: float) -> list[float]:
    """Arrival times of WATCHDOG=1 datagrams over the next `seconds` (a bounded window)."""
    times: list[float] = []
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            await daemon.notification("WATCHDOG=1", timeout=remaining)
        except AssertionError:
            break  # no ping within the rest of the window
        times.append(time.monotonic())
    return times


async def wait_for_ping_gap(daemon: Daemon, gap_s: float, within_s: float) -> None:
    """Return once no ping has come for `gap_s`; fail if that takes more than `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            await daemon.notification("WATCHDOG=1", timeout=gap_s)
        except AssertionError:
            return
    raise AssertionError(f"pings kept coming for {within_s} s; log:\n{daemon.log}")


@pytest.mark.asyncio
async def test_pings_arrive_while_idle_and_while_generating() -> None:
    async with running_daemon(ONE_THREAD, env=WATCHDOG_ENV) as daemon:
        assert "systemd watchdog: 1.0 s; pinging every 0.5 s" in daemon.log
        drain_queued_notifications(daemon)
        idle = await ping_times(daemon, 3.0)
        # 6 expected; a loaded 2-CPU machine may delay a few, never add any.
        assert 4 <= len(idle) <= 8, idle
        async with daemon.client() as client, daemon.client() as monitor:
            # Several long requests pipelined: the slot stays busy for the whole window.
            await client.start_streaming(
                *({"prompt": f"Tell a long story number {i}", "max_tokens": 300,
                   "temperature": 0, "stream": True} for i in range(6)))
            drain_queued_notifications(daemon)
            generating = await ping_times(daemon, 3.0)
            health = await monitor.final({"op": "health"})
            assert health["busy"] is True, "the window must fall inside the generation"
            # (With a 1 s interval the model load itself can go a second without a
            # progress tick, before READY=1, when systemd does not enforce the watchdog.)
            served = daemon.log.split(" loaded in ", 1)[1]
            assert "no more watchdog pings" not in served, daemon.log
            assert 4 <= len(generating) <= 8, (generating, daemon.log)


@pytest.mark.asyncio
async def test_no_pings_without_watchdog_usec_or_for_another_pid() -> None:
    async with running_daemon(env={"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) as daemon:
        drain_queued_notifications(daemon)
        assert await ping_times(daemon, 2.0) == []
        assert "systemd watchdog" not in daemon.log


@pytest.mark.asyncio
async def test_pings_stop_when_the_decode_thread_hangs_and_the_loop_still_answers() -> None:
    env = {**WATCHDOG_ENV, "SFCORE_FAILPOINT": "decode_hang", "PYTHONFAULTHANDLER": "1"}
    async with running_daemon(env=env, expect_clean_exit=False) as daemon:
        try:
            async with daemon.client() as client, daemon.client() as monitor:
                drain_queued_notifications(daemon)
                before = await ping_times(daemon, 1.2)
                assert len(before) >= 1, "pings must flow before the hang"
                await client.send({"prompt": "Hi", "max_tokens": 4})
                # The stall must outlast the 1 s interval (plus a half-interval tick)
                # before the pings stop: wait for the first 1.5 s gap, bounded.
                await wait_for_ping_gap(daemon, gap_s=1.5, within_s=15.0)
                assert await ping_times(daemon, 3.0) == []  # and they stay stopped
                # The event loop is fine: another connection is answered at once.
                health = await monitor.final({"op": "health"}, timeout=5.0)
                assert health["status"] == "ok" and health["busy"] is True
                log = await daemon.log_with("no more watchdog pings")
                served = log.split(" loaded in ", 1)[1]
                assert served.count("no more watchdog pings") == 1, log  # once
                # What systemd does next (WatchdogSignal=SIGABRT): with
                # PYTHONFAULTHANDLER=1, as the unit sets it, the log shows where
                # the decode thread is stuck.
                daemon.signal(signal.SIGABRT)
                assert await daemon.wait_exit(30.0) == -signal.SIGABRT
                log = daemon.log
                assert "Fatal Python error: Aborted" in log, log
                assert 'sfcore_daemon/engine/' in log and "in _run" in log, log
        finally:
            if daemon.process.returncode is None:
                daemon.process.kill()
                await daemon.process.wait()
