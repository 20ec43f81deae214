"""Adaptive decode threads in the real daemon, and the OpenMP spin window it starts with.

The others' load comes from a file the test writes (SFCORE_CPU_LOAD_FILE, read by
system/cpuload.py instead of the kernel's counters): the machine running the tests is
busy with other work anyway, so only a load the test decides gives the same result on
every run. The test looks at `stats` every few streamed tokens (events, not a clock),
within a deadline; nothing sleeps. The policy's logic itself is
tests/unit/engine/test_threadpolicy.py.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/system/test_adaptive_threads.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sfcore_daemon.system import openmp
from tests.kit import Client, Daemon, running_daemon

DEADLINE_S = 180.0
# Long enough for many of the policy's 0.5 s windows even on a fast, idle machine.
LONG = {"prompt": "Count from one to one thousand in words: one, two, three,",
        "max_tokens": 2000, "temperature": 0}
CONFIG: dict[str, Any] = {
    "runtime": {"n_threads": 2, "n_threads_batch": 2, "adaptive_threads": True},
    "model": {"n_ctx": 4096}}
NO_USER_SPIN = {"GOMP_SPINCOUNT": "", "OMP_WAIT_POLICY": ""}
# Tokens between two looks at `stats` while a generation streams.
LOOK_EVERY = 8


async def threads_of(client: Client) -> dict[str, Any]:
    stats = await client.final({"op": "stats"})
    threads: dict[str, Any] = stats["threads"]
    return threads


async def decode_until(daemon: Daemon, done: Callable[[dict[str, Any], float], bool]
                       ) -> dict[str, Any]:
    """Stream long generations, one after the other, and look at `stats` (on a second
    connection) every LOOK_EVERY tokens until `done(threads, seconds decoding)`; the
    generation running then is left (its connection closed)."""
    deadline = time.monotonic() + DEADLINE_S
    async with daemon.client() as watcher:
        while True:
            async with daemon.client() as generating:
                await generating.send(LONG)
                first, count = 0.0, 0
                while True:
                    line = await generating.recv()
                    assert line is not None and line["type"] in ("token", "done"), line
                    first = first or time.monotonic()
                    count += 1
                    if line["type"] == "token" and count % LOOK_EVERY:
                        continue
                    threads = await threads_of(watcher)
                    if done(threads, time.monotonic() - first):
                        return threads
                    assert time.monotonic() < deadline, f"still {threads} after {DEADLINE_S} s"
                    if line["type"] == "done":
                        break


async def metric(client: Client, name: str) -> float:
    text = (await client.final({"op": "metrics"}))["text"]
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(name + " ")]
    assert len(values) == 1, text
    return values[0]


@pytest.mark.asyncio
async def test_threads_go_down_under_load_and_come_back(tmp_path: Path) -> None:
    load = tmp_path / "load"
    load.write_text("1.5")  # other processes hold one and a half of the two CPUs
    async with running_daemon(CONFIG, env={"SFCORE_CPU_LOAD_FILE": str(load),
                                           **NO_USER_SPIN}) as daemon:
        async with daemon.client() as client:
            assert await threads_of(client) == {"decode": 2, "batch": 2, "configured": 2,
                                                "adaptive": True, "changes": 0}
            # Down to one thread. The step down is a trial the real machine judges:
            # one window later the count may be back at two, if one thread decoded
            # slower here (tests/unit/engine/test_threadpolicy.py covers both outcomes).
            await decode_until(daemon, lambda threads, _seconds: threads["changes"] >= 1)
            load.write_text("0.0")  # the load is gone
            up = await decode_until(daemon, lambda threads, _seconds: (
                threads["changes"] >= 2 and threads["decode"] == 2))
            assert up == {"decode": 2, "batch": 2, "configured": 2, "adaptive": True,
                          "changes": 2}
            assert await metric(client, "sfcore_decode_threads") == 2
            assert await metric(client, "sfcore_decode_thread_changes_total") == 2
        assert await daemon.stop() == 0  # every change is logged by the time it exits
        log = daemon.log
        assert ("decoding with 1 threads (1 batch threads): other processes use 1.5 of 2 "
                "CPUs (change 1)") in log
        assert "decoding with 2 threads (2 batch threads): " in log
        assert "(change 2)" in log and "(change 3)" not in log
        assert (f"OpenMP: GNU libgomp, GOMP_SPINCOUNT={openmp.SPIN_DEFAULT}; "
                "adaptive threads on") in log


@pytest.mark.asyncio
async def test_turned_off_the_count_stays_and_the_users_spin_count_wins(
        tmp_path: Path) -> None:
    load = tmp_path / "load"
    load.write_text("1.5")
    config = {**CONFIG, "runtime": {**CONFIG["runtime"], "adaptive_threads": False}}
    async with running_daemon(config, env={"SFCORE_CPU_LOAD_FILE": str(load),
                                           "GOMP_SPINCOUNT": "12345",
                                           "OMP_WAIT_POLICY": ""}) as daemon:
        async with daemon.client() as client:
            # Four seconds of decoding: the adaptive daemon changes within about one.
            await decode_until(daemon, lambda threads, seconds: (
                threads["changes"] > 0 or seconds > 4.0))
            assert await threads_of(client) == {"decode": 2, "batch": 2, "configured": 2,
                                                "adaptive": False, "changes": 0}
            assert await metric(client, "sfcore_decode_thread_changes_total") == 0
        log = daemon.log
        assert "OpenMP: GNU libgomp, GOMP_SPINCOUNT=12345; adaptive threads off" in log
        assert "decoding with" not in log


@pytest.mark.asyncio
async def test_reproducible_mode_adapts_too(tmp_path: Path) -> None:
    # Its row-invariant kernels sum each row on one thread, whatever the count: the
    # adaptation no longer changes bytes (docs/performance/reproducible.md).
    load = tmp_path / "load"
    load.write_text("1.5")
    config = {**CONFIG, "model": {**CONFIG["model"], "reproducible": True}}
    async with running_daemon(config, env={"SFCORE_CPU_LOAD_FILE": str(load),
                                           **NO_USER_SPIN}) as daemon:
        async with daemon.client() as client:
            assert (await threads_of(client))["adaptive"] is True
        assert "adaptive threads on" in daemon.log
