"""What the fault, property, start-up fault and soak tests check on a running daemon:
its memory and file descriptors from /proc, a state reached (polled where no event
reports it), and that it still serves. The launcher's variants they use (a daemon run
to its exit, one on a background loop) are in daemon.py, the raw sockets in ndjson.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.kit.daemon import Daemon
from tests.kit.ndjson import done_of

T = TypeVar("T")


# --- the daemon's process ------------------------------------------------------------------


def proc_status_kb(pid: int, key: str) -> int:
    """A `kB` figure of /proc/<pid>/status, such as VmRSS or RssAnon."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def rss_anon_mb(pid: int) -> float:
    return proc_status_kb(pid, "RssAnon") / 1024


def vm_rss_mb(pid: int) -> float:
    return proc_status_kb(pid, "VmRSS") / 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> dict[str, int]:
    """What the open descriptors point at ("socket:[...]" shortened to "socket"), counted."""
    targets: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        target = target.split(":[")[0] if ":[" in target else target
        targets[target] = targets.get(target, 0) + 1
    return targets


# --- waiting -------------------------------------------------------------------------------


async def poll_until(probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], *,
                     timeout: float, interval: float = 0.02, what: str = "condition") -> T:
    """Call `probe` until `accept(result)`, at most `timeout` seconds. For states that
    no event reports (the slot became idle, a request was queued)."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await probe()
        if accept(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s; last: {last!r}")
        await asyncio.sleep(interval)


async def health(daemon: Daemon, timeout: float = 30.0) -> dict[str, Any]:
    async with daemon.client() as client:
        return await client.final({"op": "health"}, timeout)


async def assert_serves(daemon: Daemon) -> None:
    """The daemon is alive and answers a NEW connection: health, then a 2-token generate."""
    assert daemon.process.returncode is None, f"daemon exited; log:\n{daemon.log}"
    async with daemon.client() as client:
        reply = await client.final({"op": "health", "id": "alive?"}, timeout=30)
        assert reply["type"] == "health" and reply["id"] == "alive?", reply
        assert reply["status"] == "ok", reply
        done = done_of(await client.request(
            {"id": "alive-gen", "prompt": "Hello", "max_tokens": 2}, timeout=60))
        assert done["id"] == "alive-gen"
        assert done["usage"]["completion_tokens"] == 2, done


