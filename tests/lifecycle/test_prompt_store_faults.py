"""The prompt store against bad files and a bad disk, with the real daemon and model:
damaged and foreign files in its folder at start, a disk read that hangs, writes that
hang. The daemon serves on, each request ends with the right text, and the store
keeps working. (The file checks themselves are fuzzed in test_statefile.py.)"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.kit import running_daemon
from tests.kit.faults import poll_until
from tests.kit.prompt_store import (
    LONG,
    OTHER,
    QUESTION_1,
    QUESTION_2,
    SHORT_PREFIXES,
    assert_restored_at_the_question,
    cache_dir,
    cache_stats,
    generate,
    state_files,
    store_config,
    warm_answer,
)

pytestmark = pytest.mark.asyncio
__all__ = ["cache_dir"]  # the fixture

MAGIC = b"SFCORE-KV-STATE\n"


def header_of(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    length = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    head: dict[str, Any] = msgspec.msgpack.decode(data[len(MAGIC) + 4:len(MAGIC) + 4 + length])
    return head


def with_header(head: dict[str, Any], payload: bytes, length: int | None = None) -> bytes:
    encoded = msgspec.msgpack.encode(head)
    return MAGIC + (len(encoded) if length is None else length).to_bytes(4, "little") \
        + encoded + payload


async def test_damaged_and_foreign_files_at_start_cost_one_warning_each(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        _, _, cold_2 = await warm_answer(daemon)
    files = state_files(cache_dir)
    folder = files[0].parent
    real = header_of(files[0])  # this daemon's fingerprint: only the broken field differs
    payload = b"\x00" * 1000
    good = {**real, "payload_bytes": len(payload)}
    bad: dict[Path, bytes] = {
        folder / ("1" * 40 + ".kv"): with_header(good, payload, 0xFFFFFFFF),
        folder / ("2" * 40 + ".kv"): with_header({**good, "tokens": b"\x01" * 5}, payload),
        folder / ("3" * 40 + ".kv"): with_header({**good, "payload_bytes": -1000}, payload),
        folder / ("4" * 40 + ".kv"): with_header({**good, "payload_crc32": "x"}, payload),
        folder / ("5" * 40 + ".kv"): os.urandom(5000),
        folder / ("6" * 40 + ".kv"): files[0].read_bytes()[:-777],  # a truncated copy
    }
    for path, data in bad.items():
        path.write_bytes(data)
    fifo = folder / ("7" * 40 + ".kv")
    os.mkfifo(fifo)  # another user's trap: reading it would block the scan for good
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        # The good states still restore, with the cold run's bytes.
        restored = await generate(client, LONG + QUESTION_2)
        assert restored["timings"]["cache_source"] == "disk"
        assert_restored_at_the_question(restored, cold_2)
        # And new ones are still written.
        written = (await cache_stats(client))["written"]
        # Longer than the 512-token window: a prompt shorter than that, after the
        # restored one, is not kept (kvcache.KVCache.state finds its BOS window row
        # missing), whatever the files.
        await generate(client, OTHER + " And again: " + OTHER)
        cache = await poll_until(lambda: cache_stats(client),
                                 lambda c: c["written"] > written, timeout=60,
                                 what="a new state written")
        assert cache["errors"] == len(bad) + 1, cache
        await client.close()
        assert await daemon.stop() == 0
        log = daemon.log
    for path in [*bad, fifo]:
        lines = [line for line in log.splitlines() if str(path) in line]
        assert len(lines) == 1 and "WARNING" in lines[0], (path, log)
    assert "Traceback" not in log and "no disk tier" not in log, log
    assert not any(path.exists() for path in bad)  # regular files: removed
    assert fifo.exists()  # not a regular file: left in place


async def test_a_hung_disk_read_is_given_up_and_later_restores_do_not_wait(
        cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        _, _, cold_2 = await warm_answer(daemon)
        async with daemon.client() as client:
            await generate(client, SHORT_PREFIXES[3] + QUESTION_1)
    timeout_ms = 1500
    config = store_config(cache_dir, disk_read_timeout_ms=timeout_ms)
    async with running_daemon(config, env={"SFCORE_FAILPOINT": "disk_read_hang"}) as daemon, \
            daemon.client() as client:
        started = time.monotonic()
        given_up = await generate(client, LONG + QUESTION_2)
        assert time.monotonic() - started >= timeout_ms / 1000
        # Evaluated instead: the cold run's bytes.
        assert given_up["timings"]["cache_source"] == "none", given_up
        assert given_up["usage"]["cached_tokens"] == 0
        assert given_up["text"] == cold_2["text"]
        # Another prefix stored on disk: the stuck read is still stuck, so this one
        # is evaluated at once rather than queued behind it (a second read would hang
        # too, and be given up with a second warning).
        later = await generate(client, SHORT_PREFIXES[3] + QUESTION_2)
        assert later["timings"]["cache_source"] != "disk", later
        assert later["usage"]["cached_tokens"] < 16
        cache = await cache_stats(client)
        assert cache["hits"]["disk"] == 0 and cache["errors"] == 1, cache
        await client.close()
        assert await daemon.stop() == 0
        log = daemon.log
    assert log.count("gave up reading") == 1, log
    assert "Traceback" not in log, log


async def test_states_waiting_for_a_hung_disk_stay_within_ram_mb(cache_dir: Path) -> None:
    # About 9 MB a state, one or two a prompt. With every write stuck, the queue alone
    # would hold them all.
    config = store_config(cache_dir, ram_mb=20)
    async with running_daemon(config, env={"SFCORE_FAILPOINT": "disk_write_hang"}) as daemon, \
            daemon.client() as client:
        for prefix in SHORT_PREFIXES:
            await generate(client, prefix + QUESTION_1)
        cache = await cache_stats(client)
        assert cache["saved"] >= len(SHORT_PREFIXES) and cache["written"] == 0, cache
        assert cache["ram_states"] < cache["saved"], cache  # some did not fit
        assert 0 < cache["ram_bytes"] <= 20 << 20, cache
        assert cache["disk_files"] == 0, cache
    # At the stop the writes went through: what was kept is on disk.
    assert state_files(cache_dir)
