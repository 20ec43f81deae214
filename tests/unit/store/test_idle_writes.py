"""The disk tier writes its files while the decode thread waits for work: not beside a
busy engine, however long a file waits, unless the queued writes hold half the RAM budget.
(The daemon tests of the store are test_prompt_store.py.)"""

from __future__ import annotations

from pathlib import Path

from sfcore_daemon.store import statefile
from sfcore_daemon.store.promptstore import PromptStore, state_name

# How long a write is given to show up where it must not (bounded: no event exists for
# "nothing happened").
QUIET_S = 0.3


def opened(directory: Path, ram: int = 1 << 20) -> PromptStore:
    store = PromptStore(directory, ram, 1 << 24, min_tokens=4)
    store.open(lambda: "a" * 64)
    assert store.wait_open(10)
    return store


def file_of(store: PromptStore, tokens: list[int]) -> Path:
    assert store.folder is not None
    return store.folder / state_name(tokens)


def test_a_file_waits_for_the_engine_to_be_idle(tmp_path: Path) -> None:
    store = opened(tmp_path, ram=64 << 20)
    try:
        store.engine_idle(False)
        tokens = [1, 2, 3, 4, 5]
        payload = bytearray(range(256)) * 40_000  # 10 MB: three parts
        assert store.put(tokens, payload)
        assert not store.flush(QUIET_S)
        assert not file_of(store, tokens).exists()
        assert store.counters.written == 0
        store.engine_idle(True)
        assert store.flush(10)
        checked = statefile.read_state(file_of(store, tokens), "a" * 64, 1 << 30, payload=True)
        assert checked is not None and checked[2] == payload  # the CRC of the parts checked
        assert store.counters.written == 1
    finally:
        store.close(10)


def test_queued_writes_holding_half_the_ram_budget_are_written_at_once(
        tmp_path: Path) -> None:
    store = opened(tmp_path, ram=2000)
    try:
        store.engine_idle(False)
        small, large = [1, 1, 1, 1], [2, 2, 2, 2]
        assert store.put(small, bytearray(b"s" * 100))
        assert not store.flush(QUIET_S)  # 100 of 2000 bytes: it waits
        assert store.put(large, bytearray(b"l" * 1000))
        assert store.flush(10)
        assert file_of(store, small).exists() and file_of(store, large).exists()
    finally:
        store.close(10)


def test_closing_writes_what_waits_for_an_idle_engine(tmp_path: Path) -> None:
    store = opened(tmp_path)
    store.engine_idle(False)
    tokens = [3, 1, 4, 1, 5]
    assert store.put(tokens, bytearray(b"p" * 1000))
    assert store.close(10)
    assert file_of(store, tokens).exists()
