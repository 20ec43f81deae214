"""The prompt store's own logic without a model: which state fits a prompt, the RAM
budget, the file format and its checks. (The daemon tests are test_prompt_store.py.)"""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sfcore_daemon.store.fingerprint import state_fingerprint
from sfcore_daemon.store.promptstore import Entry, PromptStore, state_name


def opened(directory: Path | None, ram: int = 1 << 20, disk: int = 1 << 20,
           fingerprint: str = "a" * 64) -> PromptStore:
    store = PromptStore(directory, ram, disk, min_tokens=4)
    store.open(lambda: fingerprint)
    assert store.wait_open(10)
    return store


def test_a_state_fits_a_prompt_that_starts_with_its_whole_text() -> None:
    store = opened(None)
    try:
        store.put([1, 2, 3, 4, 5], bytearray(b"x" * 10))
        store.put([1, 2, 3, 4, 5, 6, 7, 8], bytearray(b"y" * 10))
        # Extends the longer text: all of it is restored.
        entry, n, shared = store.find([1, 2, 3, 4, 5, 6, 7, 8, 9])
        assert entry is not None and entry.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and n == 8
        # Leaves the longer text early: only the shorter state can continue there.
        entry, n, shared = store.find([1, 2, 3, 4, 5, 6, 0, 0])
        assert entry is not None and n == 5 and shared == 6
        # The very text again: all but its last token, which is evaluated for logits.
        entry, n, _ = store.find([1, 2, 3, 4, 5])
        assert entry is not None and entry.tokens == [1, 2, 3, 4, 5] and n == 4
        entry, n, shared = store.find([9, 9, 9])
        assert entry is None and n == 0 and shared == 0
        # What a slot's cells would add to the store: only past its longest stored prefix.
        assert store.stored_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9]) == 8
        assert store.stored_prefix([1, 2, 3, 4, 5, 6, 0]) == 5
        assert store.stored_prefix([1, 2, 3, 4]) == 0
    finally:
        store.close(5)


def test_a_state_at_a_preferred_end_wins_within_the_slack() -> None:
    store = opened(None)
    try:
        store.put([1, 2, 3, 4, 5], bytearray(b"x" * 10))
        store.put([1, 2, 3, 4, 5, 6, 7, 8], bytearray(b"y" * 10))
        prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
        # Ends at 5, three rows short of the longest: taken with a slack of 3, not 2.
        entry, n, shared = store.find(prompt, [5], 3)
        assert entry is not None and entry.tokens == [1, 2, 3, 4, 5] and n == 5
        assert shared == 8
        entry, n, _ = store.find(prompt, [5], 2)
        assert entry is not None and n == 8
        # A preferred end no stored text has changes nothing.
        entry, n, _ = store.find(prompt, [6], 32)
        assert entry is not None and n == 8
    finally:
        store.close(10)


def test_the_ram_budget_drops_the_least_recently_used_first() -> None:
    store = opened(None, ram=25)
    try:
        store.put([1] * 4, bytearray(10))
        store.put([2] * 4, bytearray(10))
        assert store.stored_prefix([1] * 6) == 4  # used: now [2]*4 is the older one
        store.put([3] * 4, bytearray(10))
        assert store.ram_bytes == 20
        assert [store.stored_prefix([t] * 4) for t in (1, 2, 3)] == [4, 0, 4]
        assert store.counters.ram_evicted == 1
    finally:
        store.close(5)


def test_files_are_whole_checked_and_read_back(tmp_path: Path) -> None:
    payload = bytearray(range(256)) * 40
    store = opened(tmp_path)
    store.put([5, 6, 7, 8], payload)
    assert store.close(10)
    folder = tmp_path / ("a" * 32)
    files = list(folder.iterdir())
    assert [path.name for path in files] == [state_name([5, 6, 7, 8])]

    again = opened(tmp_path, ram=0)
    try:
        entry, n, _ = again.find([5, 6, 7, 8, 9])
        assert entry is not None and n == 4 and entry.data is None
        assert again.load(entry).result(10) == payload
    finally:
        again.close(5)

    # A byte flipped: the read is refused, the file removed, the state forgotten.
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 1
    files[0].write_bytes(bytes(data))
    damaged = opened(tmp_path, ram=0)
    try:
        entry, _, _ = damaged.find([5, 6, 7, 8, 9])
        assert entry is not None
        assert damaged.load(entry).result(10) is None
        assert not files[0].exists()
        assert damaged.find([5, 6, 7, 8, 9])[0] is None
        assert damaged.counters.errors == 1
    finally:
        damaged.close(5)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_writer_waits_for_idle_cores_and_the_reader_does_not(tmp_path: Path) -> None:
    """A write lands inside the decode's steps on a 2-core machine (system/background.py);
    a read is waited for by a request, so it keeps the normal priority."""
    store = opened(tmp_path)
    try:
        store.put([5, 6, 7, 8], bytearray(b"x" * 4096))
        assert store.flush(10)  # past its first write: past the priority change
        writer = store._thread
        assert writer is not None and writer.native_id is not None
        assert os.sched_getscheduler(writer.native_id) == os.SCHED_IDLE
        readers = [thread for thread in threading.enumerate()
                   if thread.name == "sfcore-cache-read" and thread.native_id is not None]
        assert readers
        assert all(os.sched_getscheduler(thread.native_id) == os.SCHED_OTHER
                   for thread in readers)
        # Whole files without an fsync: the rename is what makes one visible.
        assert [path.name for path in (tmp_path / ("a" * 32)).iterdir()] == [
            state_name([5, 6, 7, 8])]
    finally:
        store.close(5)


def test_a_file_of_another_fingerprint_is_removed_at_the_scan(tmp_path: Path) -> None:
    store = opened(tmp_path)
    store.put([1, 2, 3, 4], bytearray(100))
    store.close(10)
    path = next((tmp_path / ("a" * 32)).iterdir())
    forged = path.read_bytes().replace(b"a" * 64, b"b" * 64)
    path.write_bytes(forged)
    other = opened(tmp_path)
    try:
        assert other.counters.errors == 1 and not path.exists()
        assert other.find([1, 2, 3, 4, 5])[0] is None
    finally:
        other.close(5)


def test_the_disk_budget_spares_another_writers_file_in_progress(tmp_path: Path) -> None:
    store = opened(tmp_path, ram=0, disk=3000)
    folder = tmp_path / ("a" * 32)
    in_progress = folder / ".someone-else.partial"
    in_progress.write_bytes(bytes(1000))
    try:
        store.put([1, 1, 1, 1], bytearray(900))
        assert store.flush(10)
        store.put([2, 2, 2, 2], bytearray(900))
        assert store.flush(10)
        names = {path.name for path in folder.iterdir()}
        # 1000 + two files of ~1000 bytes exceed 3000: the older state went, the other
        # writer's file stayed.
        assert in_progress.name in names
        assert state_name([2, 2, 2, 2]) in names and state_name([1, 1, 1, 1]) not in names
        assert store.counters.disk_evicted == 1
    finally:
        store.close(5)


@pytest.mark.parametrize("size", [0, 10, 30])
def test_a_short_file_is_not_a_state(tmp_path: Path, size: int) -> None:
    folder = tmp_path / ("a" * 32)
    folder.mkdir()
    path = folder / state_name([1, 2, 3, 4])
    path.write_bytes(b"SFCORE-KV-STATE\n"[:size] + bytes(max(0, size - 16)))
    store = opened(tmp_path)
    try:
        assert not path.exists() and store.counters.errors == 1
    finally:
        store.close(5)


def test_clear_forgets_every_state_and_file_after_the_queued_writes(tmp_path: Path) -> None:
    store = opened(tmp_path, disk=1 << 20)
    folder = tmp_path / ("a" * 32)
    in_progress = folder / ".someone-else.partial"
    in_progress.write_bytes(bytes(100))
    try:
        store.put([1, 2, 3, 4], bytearray(500))
        store.put([1, 2, 3, 4, 5, 6], bytearray(700))
        listed = store.states(3)
        assert [(s.tokens, s.n_tokens, s.nbytes) for s in listed] == [
            ([1, 2, 3], 6, 700), ([1, 2, 3], 4, 500)]  # most recently used first
        assert all(s.ram and s.disk for s in listed)
        # Queued right behind the two writes: they are done first, then removed.
        cleared = store.clear().result(10)
        assert cleared.states == 2 and cleared.files == 2 and cleared.bytes > 1200
        assert store.states(3) == []
        assert store.find([1, 2, 3, 4, 5, 6, 7])[0] is None
        assert store.figures() == (0, 0, 0, 0)
        assert [path.name for path in folder.iterdir()] == [in_progress.name]
        # The store goes on as before.
        store.put([7, 7, 7, 7], bytearray(300))
        assert store.flush(10)
        assert [s.n_tokens for s in store.states(1)] == [4]
        assert (folder / state_name([7, 7, 7, 7])).exists()
    finally:
        store.close(5)


def test_queued_writes_count_against_the_ram_budget(tmp_path: Path) -> None:
    # The store's thread is stuck on its first write (a slow fsync, or the model's
    # first hash): the states queued behind it, with those in RAM, stay within ram_mb
    # (a state that finds the budget held by unwritten states is not kept).
    store = opened(tmp_path, ram=300_000, disk=1 << 24)
    release = threading.Event()
    write = store._write

    def stuck(entry: Entry, data: bytearray, ready: Callable[[], None] = lambda: None
              ) -> None:
        release.wait(30)
        write(entry, data, ready)

    store._write = stuck  # type: ignore[method-assign]
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for n in range(10):
            store.put([n] * 8, bytearray(100_000))
        held, _ = tracemalloc.get_traced_memory()
        assert held - before < 300_000 + 100_000, f"{held - before} bytes held"
        assert store.figures()[0] <= 300_000
    finally:
        tracemalloc.stop()
        release.set()
    try:
        assert store.flush(10)
        # What was kept is written, and stays in RAM within the budget.
        kept = [n for n in range(10) if store.stored_prefix([n] * 8)]
        assert 1 <= len(kept) <= 3
        folder = tmp_path / ("a" * 32)
        assert {path.name for path in folder.iterdir()} == {state_name([n] * 8) for n in kept}
        assert store.figures()[0] <= 300_000
    finally:
        store.close(5)


def test_a_state_larger_than_the_ram_budget_goes_to_disk_alone(tmp_path: Path) -> None:
    store = opened(tmp_path, ram=1000, disk=1 << 24)
    try:
        store.put([1] * 8, bytearray(5000))
        assert store.flush(10)
        entry, _, _ = store.find([1] * 9)
        assert entry is not None and entry.data is None and entry.path is not None
        assert store.figures()[0] == 0  # written: nothing of it is held
        assert store.load(entry).result(10) == bytearray(5000)
    finally:
        store.close(5)


def test_the_disk_budget_is_over_every_fingerprints_folder(tmp_path: Path) -> None:
    # An upgrade left a folder of another fingerprint; a folder and a file of other
    # names under dir are not the store's.
    old = tmp_path / ("b" * 32)
    old.mkdir()
    for n in range(3):
        path = old / f"{n}.kv"
        path.write_bytes(bytes(1000))
        os.utime(path, ns=(10**18 + n, 10**18 + n))
    other = tmp_path / "notes"
    other.mkdir()
    (other / "big").write_bytes(bytes(5000))
    (tmp_path / "README").write_bytes(bytes(5000))
    # At start, over the budget already: the oldest of the old folder's files go.
    store = opened(tmp_path, ram=1 << 20, disk=2500)
    folder = tmp_path / ("a" * 32)
    try:
        assert sorted(path.name for path in old.iterdir()) == ["1.kv", "2.kv"]
        store.put([1] * 8, bytearray(1400))  # ~1550 bytes with its header
        assert store.flush(10)
        # The new state fits by removing the old fingerprint's files first; its
        # folder, now empty, goes too.
        assert not old.exists()
        assert [path.name for path in folder.iterdir()] == [state_name([1] * 8)]
        assert (other / "big").exists() and (tmp_path / "README").exists()
        assert store.counters.disk_evicted == 3
    finally:
        store.close(5)


def test_a_read_past_its_bound_is_given_up_and_later_ones_skip_the_stuck_disk(
        tmp_path: Path) -> None:
    store = PromptStore(tmp_path, 0, 1 << 20, min_tokens=4, read_timeout_s=0.05)
    store.open(lambda: "a" * 64)
    assert store.wait_open(10)
    release = threading.Event()
    read = store._read

    def hung(entry: Any) -> bytearray | None:
        release.wait(30)
        return read(entry)

    store._read = hung  # type: ignore[method-assign]
    try:
        for n in (1, 2):  # disk only (ram 0): one write at a time
            store.put([n] * 8, bytearray(b"xy"[n - 1:n] * 100))
            assert store.flush(10)
        first, _, _ = store.find([1] * 9)
        second, _, _ = store.find([2] * 9)
        assert first is not None and second is not None
        stuck = store.load(first)
        queued = store.load(second)
        deadline = time.monotonic() + 10
        while not store.read_overdue():  # a timeout, not an event: polled, bounded
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not stuck.done()
        assert queued.cancel()  # given up while behind the stuck one: never read
        release.set()
        assert stuck.result(10) == bytearray(b"x" * 100)
        assert not store.read_overdue()
        assert store.load(second).result(10) == bytearray(b"y" * 100)
    finally:
        release.set()
        store.close(5)


_FINGERPRINTED: dict[str, Any] = {
    "model_sha256": "0" * 64, "llama_cpp": "0.3.16", "flash_attn": "auto", "n_ubatch": 512,
    "gpu_layers": "auto", "system_info": "CPU : AVX2 = 1 |"}


def test_the_fingerprint_is_the_same_hash_of_the_same_values() -> None:
    # Pinned: another hash of the same values would orphan every state file on disk
    # (its folder is named after it), so a change of the recipe must be a deliberate one
    # (with STATE_FORMAT bumped when the file format changes).
    assert state_fingerprint(**_FINGERPRINTED) == (
        "75fa67bae301bb3e587e8f237af3ccbd9407c00d16f605cb12120bae080dc245")


@pytest.mark.parametrize("field, other", [
    ("model_sha256", "1" * 64), ("llama_cpp", "0.3.17"), ("flash_attn", True),
    ("n_ubatch", 256), ("gpu_layers", 0), ("system_info", "CPU : AVX2 = 0 |"),
    ("rewritten", True)])
def test_every_value_the_engine_passes_changes_the_fingerprint(field: str, other: Any) -> None:
    assert state_fingerprint(**{**_FINGERPRINTED, field: other}) != \
        state_fingerprint(**_FINGERPRINTED)
