"""One prompt state on disk: the file format and the checks a file passes before a byte
of it is trusted (the store itself is promptstore.py).

A file is MAGIC, the header's length (u32, little-endian), the header (msgpack of
StateHeader) and the payload: the bytes `llama_state_seq_get_data` gave.

Whatever lies in the store's folder may be anything: a crashed writer's leftover, a
truncated copy, another version's file, a sparse file, a FIFO, a hostile local user's
forgery. So a file is opened once, without following links or blocking, and must be a
regular file; every length is checked against the file's real size and a fixed cap
before anything is allocated; every header field is checked for its type, range and
size before it is used; and the payload is read from the same open file and checked
against its CRC-32 before llama.cpp sees it. A check that fails raises BadStateFile
with the reason, for the one warning line the store logs.
"""

from __future__ import annotations

import array
import hashlib
import io
import os
import stat
import zlib
from pathlib import Path
from typing import Annotated

import msgspec

MAGIC = b"SFCORE-KV-STATE\n"
_LENGTH = 4  # the header's length, little-endian, after the magic
PREFIX = len(MAGIC) + _LENGTH
SUFFIX = ".kv"
# 16 M tokens of 4 bytes, far past any context a state could come from; a sparse file
# can claim any size, so the file's size alone bounds nothing.
MAX_HEADER = 64 << 20
_READ_CHUNK = 8 << 20
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StateHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fingerprint: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    # int32, native order (the fingerprint binds the machine)
    tokens: Annotated[bytes, msgspec.Meta(min_length=4)]
    payload_bytes: Annotated[int, msgspec.Meta(ge=1)]
    payload_crc32: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StateHeader)


class BadStateFile(Exception):
    """A file that is not a state this store may load. `removable`: it is a regular
    file whose contents are wrong (safe to delete); otherwise it is left in place (not a
    regular file, or unreadable, which may pass)."""

    def __init__(self, reason: str, *, removable: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.removable = removable
        self.info: os.stat_result | None = None  # (read_state) the file's, if removable


def state_name(tokens: list[int]) -> str:
    """The file name of the state of `tokens` (within a fingerprint's folder)."""
    return hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()[:40] + SUFFIX


def encode(fingerprint: str, tokens: list[int], payload: bytes | bytearray,
           crc32: int | None = None) -> bytes:
    """What a file holds before its payload: the magic, the header's length, the header.
    `crc32`: the payload's, if already worked out."""
    header = _header_encoder.encode(StateHeader(
        fingerprint=fingerprint, tokens=array.array("i", tokens).tobytes(),
        payload_bytes=len(payload),
        payload_crc32=zlib.crc32(payload) if crc32 is None else crc32))
    return MAGIC + len(header).to_bytes(_LENGTH, "little") + header


def open_state(path: Path) -> tuple[io.FileIO, os.stat_result]:
    """The file at `path`, opened for reading, and its stat (BadStateFile unless it is a
    regular file; FileNotFoundError if it is gone)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        # ELOOP: a symbolic link (O_NOFOLLOW); ENXIO and others: not ours to judge.
        raise BadStateFile(f"cannot be opened ({exc.strerror})", removable=False) from None
    file = io.FileIO(fd, "r")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadStateFile("not a regular file", removable=False)
    except BaseException:
        file.close()
        raise
    return file, info


def read_state(path: Path, fingerprint: str, max_file_bytes: int, *, payload: bool
               ) -> tuple[StateHeader, int, bytearray | None] | None:
    """The checked header of the state file at `path`, its size and (`payload`) its
    checked payload, all read from one open file; None if there is no file there.
    Anything wrong with it, an I/O error included, raises BadStateFile; its `info` is
    the stat of the file read when the file may be removed (disk.remove_if_same)."""
    info: os.stat_result | None = None
    try:
        file, info = open_state(path)
        with file:
            header = read_header(file, info.st_size, fingerprint, path.name, max_file_bytes)
            data = read_payload(file, header) if payload else None
    except FileNotFoundError:
        return None  # removed meanwhile (by hand, or another daemon sharing the folder)
    except BadStateFile as exc:
        exc.info = info if exc.removable else None
        raise
    except OSError as exc:  # an I/O error may pass: the file is left
        raise BadStateFile(f"unreadable ({exc.strerror or exc})", removable=False) from None
    except Exception as exc:  # MemoryError, or a bug: this file only, never the disk tier
        raise BadStateFile(f"unreadable ({type(exc).__name__}: {exc})",
                           removable=False) from None
    return header, info.st_size, data


def read_header(file: io.FileIO, size: int, fingerprint: str, name: str,
                max_file_bytes: int) -> StateHeader:
    """The checked header of an open state file of `size` bytes, whose name is `name`;
    BadStateFile if anything is wrong with it. Reads at most PREFIX + MAX_HEADER bytes."""
    head = _read_exact(file, PREFIX) if size >= PREFIX else b""
    if head[:len(MAGIC)] != MAGIC:
        raise BadStateFile("not a state file")
    length = int.from_bytes(head[len(MAGIC):], "little")
    if length > min(MAX_HEADER, size - PREFIX):
        raise BadStateFile(f"a header of {length} bytes in a file of {size} (truncated or "
                           "damaged)")
    try:
        header = _header_decoder.decode(_read_exact(file, length))
    # ValidationError is a DecodeError; a msgpack string that is not UTF-8 raises
    # UnicodeDecodeError, a ValueError.
    except (msgspec.DecodeError, ValueError) as exc:
        raise BadStateFile(f"damaged header ({exc})") from None
    if header.fingerprint != fingerprint:
        raise BadStateFile("made by another model, llama.cpp build or layout")
    if len(header.tokens) % 4:
        raise BadStateFile(f"damaged header (tokens of {len(header.tokens)} bytes)")
    if size != PREFIX + length + header.payload_bytes:
        raise BadStateFile(f"{size} bytes, not the {PREFIX + length + header.payload_bytes} "
                           "its header announces (truncated)")
    if size > max_file_bytes:
        raise BadStateFile(f"{size} bytes, over the disk budget")
    if name != state_name(tokens_of(header)):
        raise BadStateFile("its name does not match its tokens")
    return header


def read_payload(file: io.FileIO, header: StateHeader) -> bytearray:
    """The payload that follows the header just read from `file`, checked against its
    CRC-32 (BadStateFile if it is short or does not match)."""
    data = bytearray(header.payload_bytes)
    if _read_into(file, data) != len(data) or zlib.crc32(data) != header.payload_crc32:
        raise BadStateFile("its payload does not match its checksum")
    return data


def tokens_of(header: StateHeader) -> list[int]:
    return array.array("i", header.tokens).tolist()


def _read_exact(file: io.FileIO, n: int) -> bytes:
    data = bytearray(n)
    if _read_into(file, data) != n:
        raise BadStateFile("shorter than it was a moment ago (truncated)")
    return bytes(data)


def _read_into(file: io.FileIO, data: bytearray) -> int:
    view = memoryview(data)
    done = 0
    try:
        while done < len(data):
            n = file.readinto(view[done:done + _READ_CHUNK])
            if not n:
                break
            done += n
    finally:
        view.release()
    return done
