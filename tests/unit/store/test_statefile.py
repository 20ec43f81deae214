"""Whatever lies in the prompt store's folder (a crash's leftover, a truncated copy,
another version's file, random bytes, a hostile header, a FIFO or a link) is either a
valid state or skipped with one warning: never a traceback, never a huge allocation,
never the end of the disk tier. Unit level, no model; the daemon's side is in
test_prompt_store_faults.py."""

from __future__ import annotations

import array
import logging
import os
import tempfile
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.store.promptstore import PromptStore, state_name

MAGIC = b"SFCORE-KV-STATE\n"
FINGERPRINT = "a" * 64
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST_FUZZ = settings(max_examples=300, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def header(tokens: list[int], payload: bytes, /, **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "fingerprint": FINGERPRINT, "tokens": array.array("i", tokens).tobytes(),
        "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload)}
    values.update(fields)
    return values


def state_file(head: Any, payload: bytes, length: int | None = None) -> bytes:
    encoded = msgspec.msgpack.encode(head)
    length = len(encoded) if length is None else length
    return MAGIC + length.to_bytes(4, "little") + encoded + payload


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextmanager
def store_log() -> Iterator[Records]:
    logger = logging.getLogger("sfcore_daemon")
    records = Records()
    logger.addHandler(records)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(old)


@contextmanager
def opened(root: Path, disk: int = 1 << 24, ram: int = 1 << 20) -> Iterator[PromptStore]:
    store = PromptStore(root, ram, disk, min_tokens=1)
    store.open(lambda: FINGERPRINT)
    try:
        assert store.wait_open(10), "the scan did not finish"
        yield store
    finally:
        store.close(10)


def assert_still_writes(store: PromptStore, folder: Path) -> None:
    """The disk tier is on: a new state is written."""
    tokens = [7, 7, 7, 7, 7]
    store.put(tokens, bytearray(b"fresh" * 20))
    assert store.flush(10)
    assert (folder / state_name(tokens)).is_file(), "the disk tier is off"


# --- hostile files at the scan ----------------------------------------------------------------

GOOD = [1, 2, 3, 4]
PAYLOAD = bytes(range(200))

HOSTILE: dict[str, bytes] = {
    # 4 GiB announced, 20 bytes there: nothing of that size may be allocated.
    "absurd header length": state_file(header(GOOD, PAYLOAD), PAYLOAD, 0xFFFFFFFF),
    "tokens not a multiple of 4": state_file(header(GOOD, PAYLOAD, tokens=b"\x01" * 5), PAYLOAD),
    "negative payload_bytes": state_file(header(GOOD, PAYLOAD, payload_bytes=-200), PAYLOAD),
    "payload_bytes a string": state_file(header(GOOD, PAYLOAD, payload_bytes="200"), PAYLOAD),
    "crc32 past 32 bits": state_file(header(GOOD, PAYLOAD, payload_crc32=1 << 40), PAYLOAD),
    "tokens a list": state_file(header(GOOD, PAYLOAD, tokens=[1, 2, 3, 4]), PAYLOAD),
    "fingerprint bytes": state_file(header(GOOD, PAYLOAD, fingerprint=b"a" * 64), PAYLOAD),
    "header an array": state_file([1, 2, 3], PAYLOAD),
    "header a string": state_file("hello", PAYLOAD),
    "unknown field": state_file(header(GOOD, PAYLOAD, extra=1), PAYLOAD),
    "empty tokens": state_file(header([], PAYLOAD), PAYLOAD),
    "random bytes": bytes(range(256)) * 3,
    "magic alone": MAGIC,
    "truncated": state_file(header(GOOD, PAYLOAD), PAYLOAD)[:-50],
    "header cut short": state_file(header(GOOD, PAYLOAD), PAYLOAD)[:40],
    # A msgpack string that is not UTF-8 (found by the fuzz below: a flipped bit).
    "fingerprint not UTF-8": state_file(header(GOOD, PAYLOAD), PAYLOAD).replace(
        FINGERPRINT.encode(), b"\xe1" + FINGERPRINT.encode()[1:], 1),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_file_is_skipped_with_one_warning_and_the_tier_stays_on(
        tmp_path: Path, kind: str) -> None:
    folder = tmp_path / ("a" * 32)
    folder.mkdir()
    path = folder / state_name(GOOD)
    path.write_bytes(HOSTILE[kind])
    tracemalloc.start()
    try:
        with store_log() as log, opened(tmp_path) as store:
            _, peak = tracemalloc.get_traced_memory()
            assert peak < 16 << 20, f"{peak} bytes allocated for a {len(HOSTILE[kind])}-byte file"
            assert store.counters.errors == 1
            assert store.find([*GOOD, 9])[0] is None
            assert not path.exists()  # a regular file with wrong contents: removed
            warnings = log.at(logging.WARNING)
            assert len(warnings) == 1 and str(path) in warnings[0], warnings
            assert not log.at(logging.ERROR)
            assert_still_writes(store, folder)
    finally:
        tracemalloc.stop()


def test_a_fifo_a_link_and_a_folder_are_skipped_and_left_in_place(tmp_path: Path) -> None:
    folder = tmp_path / ("a" * 32)
    folder.mkdir()
    target = tmp_path / "elsewhere"
    target.write_bytes(state_file(header(GOOD, PAYLOAD), PAYLOAD))
    fifo = folder / state_name([1])
    os.mkfifo(fifo)  # opened for reading without O_NONBLOCK, the scan would hang
    link = folder / state_name(GOOD)
    link.symlink_to(target)
    directory = folder / state_name([2])
    directory.mkdir()
    with store_log() as log, opened(tmp_path) as store:
        assert store.counters.errors == 3
        warnings = log.at(logging.WARNING)
        assert len(warnings) == 3, warnings
        for path in (fifo, link, directory):
            assert sum(str(path) in line for line in warnings) == 1, warnings
            assert os.path.lexists(path)
        assert target.exists() and store.find([*GOOD, 9])[0] is None
        assert_still_writes(store, folder)


def test_a_read_racing_rewrites_of_its_file_never_removes_it(tmp_path: Path) -> None:
    # Another writer (a second daemon sharing the folder) replaces the file again and
    # again with whole, valid states of other sizes while this store loads it: every
    # load is one of those states, and the file is never removed. (Read by name twice,
    # a load took one file's header and another's payload, and removed the good file.)
    folder = tmp_path / ("a" * 32)
    folder.mkdir()
    payloads = [bytes([n]) * (3000 + 500 * n) for n in range(4)]
    versions = [state_file(header(GOOD, p), p) for p in payloads]
    path = folder / state_name(GOOD)
    path.write_bytes(versions[0])
    stop = threading.Event()

    def rewrite() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            partial = folder / f".other.{n}.partial"
            partial.write_bytes(versions[n % len(versions)])
            os.replace(partial, path)

    with opened(tmp_path, ram=0) as store:
        entry = store.find([*GOOD, 9])[0]
        assert entry is not None
        writer = threading.Thread(target=rewrite, daemon=True)
        writer.start()
        try:
            for _ in range(600):
                data = store.load(entry).result(10)
                assert data is not None and bytes(data) in payloads, "a good file was refused"
                assert path.exists()
        finally:
            stop.set()
            writer.join(10)
        assert store.counters.errors == 0


# --- generated files -------------------------------------------------------------------------

_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                    st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=24),
                    st.lists(st.integers(0, 9), max_size=3))
_FIELDS = ["fingerprint", "tokens", "payload_bytes", "payload_crc32", "other"]


@st.composite
def files(draw: st.DrawFn) -> tuple[list[int], bytes, bytes, str]:
    """(tokens, payload, the file's bytes, how they were made)."""
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40))
    payload = draw(st.binary(min_size=1, max_size=1500))
    valid = state_file(header(tokens, payload), payload)
    kind = draw(st.sampled_from(["valid", "truncated", "flipped", "fields", "hostile",
                                 "length", "random"]))
    data = valid
    if kind == "truncated":
        data = valid[:draw(st.integers(0, len(valid) - 1))]
    elif kind == "flipped":
        flipped = bytearray(valid)
        for _ in range(draw(st.integers(1, 3))):
            flipped[draw(st.integers(0, len(valid) - 1))] ^= 1 << draw(st.integers(0, 7))
        data = bytes(flipped)
    elif kind == "fields":  # some fields of the right name, any type and value
        values = draw(st.dictionaries(st.sampled_from(_FIELDS), _VALUES))
        data = state_file(header(tokens, payload, **values), payload)
    elif kind == "hostile":  # any msgpack value as the header
        data = state_file(draw(st.recursive(
            _VALUES, lambda inner: st.lists(inner, max_size=3)
            | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=8)),
            payload)
    elif kind == "length":  # any announced header length
        encoded = msgspec.msgpack.encode(header(tokens, payload))
        data = MAGIC + draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little") + encoded + payload
    elif kind == "random":
        data = draw(st.binary(max_size=300))
        if draw(st.booleans()):
            data = MAGIC + data
    return tokens, payload, data, kind


@FUZZ
@given(files())
def test_every_generated_file_is_a_valid_state_or_a_clean_rejection(
        made: tuple[list[int], bytes, bytes, str]) -> None:
    tokens, payload, data, kind = made
    with tempfile.TemporaryDirectory(prefix="sfstatefuzz") as directory:
        root = Path(directory)
        folder = root / ("a" * 32)
        folder.mkdir()
        path = folder / state_name(tokens)
        path.write_bytes(data)
        with store_log() as log, opened(root, ram=0) as store:
            entry = store.find([*tokens, -1])[0]
            if entry is not None:  # its header passed: the payload decides
                loaded = store.load(entry).result(10)
                assert loaded is None or bytes(loaded) == payload
                if kind == "valid":
                    assert loaded is not None and bytes(loaded) == payload
            else:
                assert kind != "valid"
            assert store.counters.errors == (0 if path.exists() else 1)
            assert len(log.at(logging.WARNING)) == store.counters.errors
            assert not log.at(logging.ERROR)
            assert_still_writes(store, folder)


@FAST_FUZZ
@given(files())
def test_the_reader_alone_gives_the_state_or_bad_state_file(
        made: tuple[list[int], bytes, bytes, str]) -> None:
    from sfcore_daemon.store.statefile import BadStateFile, read_state

    tokens, payload, data, kind = made
    with tempfile.TemporaryDirectory(prefix="sfstatefuzz") as directory:
        path = Path(directory) / state_name(tokens)
        path.write_bytes(data)
        try:
            read = read_state(path, FINGERPRINT, 1 << 20, payload=True)
        except BadStateFile as exc:
            assert exc.reason and kind != "valid"
            assert (exc.info is not None) == exc.removable
            return
        assert read is not None
        head, size, loaded = read
        assert loaded == payload and size == len(data)
        assert array.array("i", head.tokens).tolist() == tokens
