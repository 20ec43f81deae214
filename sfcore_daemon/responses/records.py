"""Stored responses on disk: one file per response, checked before a byte of it is
served, written whole or not at all (store.py keeps the index and the bounds).

A file is `<id>.resp` in the responses' folder (`[cache] dir` + `/responses`): MAGIC,
the payload's length and its CRC-32 (u32 each, little-endian), then the payload, the
JSON of a `Record`. What lies in the folder may be anything (a crashed writer's
leftover, a truncated copy, a damaged disk), so a file is opened without following
links, must be a regular file no larger than the store's budget, and its length,
checksum, JSON, fields and id are all checked: anything wrong raises DamagedRecord,
and the store drops the file and logs it, never serves it.

Writes and removals run on one writer thread, in the order they were asked for (a
removal after a write of the same id removes it); the thread is not a daemon thread
and ends once its queue is empty, so what was queued before the daemon exits is
written before the process ends. Each write goes to a temporary file (mode 0600),
synced, then renamed over the record.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import stat
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from sfcore_daemon.core.request import Message

log = logging.getLogger(__name__)

MAGIC = b"SFCORE-RESPONSE\n"
_LENGTH = 4
PREFIX = len(MAGIC) + 2 * _LENGTH
SUFFIX = ".resp"
_TMP = ".tmp"
# Ids are the daemon's own (reply.py): a file of another name is not a record.
ID = re.compile(r"resp_[0-9a-f]{24}")
# A temporary file older than this is a crashed writer's leftover.
_STALE_TMP_S = 3600.0
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_MODE = 0o600
FOLDER_MODE = 0o700


class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a stored response's next turn, GET and input_items need."""

    id: str
    # Every message up to and with the response's output, instructions aside.
    conversation: list[Message]
    # The input items as input_items lists them (the earlier turns' too).
    items: list[dict[str, Any]]
    # The response object's JSON, served as it is.
    body: msgspec.Raw


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


class DamagedRecord(Exception):
    """A record file that must not be served; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode_record(record: Record) -> bytes:
    payload = _encoder.encode(record)
    return (MAGIC + len(payload).to_bytes(_LENGTH, "little")
            + zlib.crc32(payload).to_bytes(_LENGTH, "little") + payload)


def decode_record(data: bytes, response_id: str) -> Record:
    """The record in `data`, the whole file of `response_id`; DamagedRecord if
    anything about it is wrong."""
    if len(data) < PREFIX or data[:len(MAGIC)] != MAGIC:
        raise DamagedRecord("not a response record")
    length = int.from_bytes(data[len(MAGIC):len(MAGIC) + _LENGTH], "little")
    if length != len(data) - PREFIX:
        raise DamagedRecord(f"{len(data)} bytes, not the {PREFIX + length} its header "
                            "announces (truncated)")
    payload = data[PREFIX:]
    if zlib.crc32(payload) != int.from_bytes(data[PREFIX - _LENGTH:PREFIX], "little"):
        raise DamagedRecord("checksum mismatch (damaged)")
    try:
        record = _decoder.decode(payload)
    # ValidationError is a DecodeError; text that is not UTF-8 is a ValueError.
    except (msgspec.DecodeError, ValueError) as exc:
        raise DamagedRecord(f"damaged contents ({exc})") from None
    if record.id != response_id:
        raise DamagedRecord(f"holds {record.id!r}, not {response_id!r}")
    if not bytes(record.body).startswith(b"{"):
        raise DamagedRecord("its response is not an object")
    return record


def record_path(folder: Path, response_id: str) -> Path:
    return folder / (response_id + SUFFIX)


def read_record(folder: Path, response_id: str, max_bytes: int) -> Record | None:
    """The checked record of `response_id`; None if there is no file. DamagedRecord
    if the file may not be served (an I/O error included)."""
    path = record_path(folder, response_id)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DamagedRecord(f"cannot be opened ({exc.strerror})") from None
    try:
        with io.FileIO(fd, "r") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise DamagedRecord("not a regular file")
            if info.st_size > max_bytes:
                raise DamagedRecord(f"{info.st_size} bytes, over the store's budget")
            data = file.read(info.st_size + 1)
    except OSError as exc:
        raise DamagedRecord(f"unreadable ({exc.strerror or exc})") from None
    return decode_record(data, response_id)


class Found(NamedTuple):
    response_id: str
    size: int
    mtime_ns: int


def scan(folder: Path) -> list[Found]:
    """The records in `folder`, least recently used first (a GET or a next turn
    touches its file); a crashed writer's old temporary files are removed."""
    found = []
    now = time.time()
    for name in os.listdir(folder):
        path = folder / name
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode):
            continue
        if name.endswith(_TMP):
            if now - info.st_mtime > _STALE_TMP_S:
                with contextlib.suppress(OSError):
                    path.unlink()
            continue
        response_id = name.removesuffix(SUFFIX)
        if name.endswith(SUFFIX) and ID.fullmatch(response_id):
            found.append(Found(response_id, info.st_size, info.st_mtime_ns))
    found.sort(key=lambda item: item.mtime_ns)
    return found


class RecordWriter:
    """The records' writes, touches and removals, in order, off the event loop."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._queue: deque[tuple[str, str, bytes]] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def write(self, response_id: str, data: bytes) -> None:
        self._put(("write", response_id, data))

    def touch(self, response_id: str) -> None:
        self._put(("touch", response_id, b""))

    def remove(self, response_id: str) -> None:
        self._put(("remove", response_id, b""))

    def wait_idle(self, timeout: float) -> bool:
        """Whether everything queued has been done within `timeout` (tests, shutdown)."""
        return self._idle.wait(timeout)

    def _put(self, op: tuple[str, str, bytes]) -> None:
        with self._lock:
            self._queue.append(op)
            self._idle.clear()
            if self._thread is None:
                # Not a daemon thread: the interpreter waits for the queued writes.
                self._thread = threading.Thread(target=self._run, name="sfcore-responses")
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._idle.set()
                    return
                kind, response_id, data = self._queue.popleft()
            try:
                self._do(kind, response_id, data)
            except OSError as exc:
                log.warning("stored response %s: %s failed (%s)", response_id, kind,
                            exc.strerror or exc)

    def _do(self, kind: str, response_id: str, data: bytes) -> None:
        path = record_path(self.folder, response_id)
        if kind == "write":
            tmp = self.folder / f"{response_id}.{os.getpid()}{_TMP}"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            fd = os.open(tmp, _WRITE_FLAGS, FILE_MODE)
            try:
                with io.FileIO(fd, "w") as file:
                    view = memoryview(data)
                    while view:
                        view = view[file.write(view) or 0:]
                    os.fsync(fd)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        elif kind == "touch":
            with contextlib.suppress(FileNotFoundError):
                os.utime(path, follow_symlinks=False)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
