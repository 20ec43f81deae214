"""Prompt states kept after their slot lets them go: a RAM tier and a disk tier.

A state is what `llama_state_seq_get_data` returns for one sequence: the K and V rows
of its cells, position by position. Restoring it (kvcache.KVCache.restore) puts the
same rows back, so a long prefix is read in milliseconds instead of evaluated again.

Each state is stored with the exact tokens its cells hold. A file on disk also carries
the fingerprint of everything that decides the rows' layout and numbers (the model
file's sha256, the llama.cpp build, the context parameters, the CPU features): files
live in a folder named after it, and a file whose header names another fingerprint is
never loaded. The payload's CRC-32 is checked before llama.cpp sees a byte of it, so a
truncated or damaged file is skipped (one warning, the file removed), never restored.

Threads: the decode thread calls `find`, `covered`, `put` and `take_ram` (no I/O, no
logging: a lock held for microseconds); the store's own thread hashes the model, scans
the folder and writes files; a reader thread loads files for the decode thread.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgspec

from .config import CacheConfig
from .kvcache import shared_prefix
from .models import cache_dir

log = logging.getLogger(__name__)

_MAGIC = b"SFCORE-KV-STATE\n"
_LENGTH = 4  # the header's length, little-endian, after the magic
_SUFFIX = ".kv"
_READ_CHUNK = 8 << 20
# A temporary file older than this is a crashed writer's leftover, and may be removed.
_STALE_PARTIAL_NS = 3600 * 10**9


class StateHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    fingerprint: str
    tokens: bytes  # int32, native order (the fingerprint binds the machine)
    payload_bytes: int
    payload_crc32: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StateHeader)


class Entry:
    """One stored state: its tokens, and where its bytes are (RAM, disk, or both)."""

    __slots__ = ("tokens", "name", "nbytes", "data", "path", "file_bytes", "used", "writing")

    def __init__(self, tokens: list[int], name: str, nbytes: int) -> None:
        self.tokens = tokens
        self.name = name
        self.nbytes = nbytes
        self.data: bytearray | None = None
        self.path: Path | None = None
        self.file_bytes = 0
        self.used = 0  # the store's use counter when last saved or restored
        self.writing = False  # queued for the disk tier, not yet written


class CacheCounters(msgspec.Struct, kw_only=True):
    """What the store did since start (the `stats` op adds the hits it counts)."""

    saved: int = 0  # states taken from a slot
    written: int = 0  # files written
    ram_evicted: int = 0
    disk_evicted: int = 0
    errors: int = 0  # unreadable, damaged or foreign files, failed writes and restores


class _Write:
    """A state on its way to disk; it holds the bytes the RAM tier may drop first."""

    __slots__ = ("entry", "data")

    def __init__(self, entry: Entry, data: bytearray) -> None:
        self.entry = entry
        self.data = data


class Cleared(msgspec.Struct, frozen=True):
    states: int
    files: int
    bytes: int


class StateView(msgspec.Struct, frozen=True):
    """What `states` tells of one stored state."""

    tokens: list[int]  # its first tokens only (for a preview)
    n_tokens: int
    nbytes: int
    ram: bool
    disk: bool


def state_name(tokens: list[int]) -> str:
    """The file name of the state of `tokens` (within a fingerprint's folder)."""
    import hashlib

    return hashlib.sha256(array.array("i", tokens).tobytes()).hexdigest()[:40] + _SUFFIX


class PromptStore:
    """States of long prefixes in RAM (bounded) and in one folder on disk (bounded).

    `open` starts the store's thread: it works out the fingerprint (which may hash the
    model file once) and reads the headers of the files already there; until then the
    disk tier is empty and the RAM tier works as usual.
    """

    def __init__(self, directory: Path | None, ram_bytes: int, disk_bytes: int,
                 min_tokens: int) -> None:
        self.root = directory
        self.ram_budget = ram_bytes
        self.disk_budget = disk_bytes if directory is not None else 0
        self.min_tokens = min_tokens
        self.counters = CacheCounters()
        self.folder: Path | None = None  # root / fingerprint, once known
        self.fingerprint = ""
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._uses = 0
        self.ram_bytes = 0
        self.disk_bytes = 0
        self._writes: queue.SimpleQueue[_Write | Future[Cleared] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="sfcore-cache-read")
        self._flushed = threading.Condition()
        self._pending = 0  # writes queued and not yet done
        self._opened = threading.Event()

    # --- lifetime -------------------------------------------------------------------

    def open(self, fingerprint: Callable[[], str]) -> None:
        """Start the store's thread; `fingerprint` runs on it (it may hash the model)."""
        self._thread = threading.Thread(target=self._main, args=(fingerprint,),
                                        name="sfcore-cache", daemon=True)
        self._thread.start()

    def wait_open(self, timeout: float) -> bool:
        """Wait until the folder is indexed (or the store found it cannot have one)."""
        return self._opened.wait(timeout)

    def close(self, timeout: float) -> bool:
        """Write what is queued (at most `timeout` seconds), then stop the threads."""
        deadline = time.monotonic() + timeout
        flushed = self.flush(timeout)
        self._writes.put(None)
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        self._reader.shutdown(wait=False, cancel_futures=True)
        return flushed

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done; False if `timeout` ran out first."""
        with self._flushed:
            return self._flushed.wait_for(lambda: self._pending == 0, timeout)

    # --- the decode thread ------------------------------------------------------------

    def find(self, prompt: list[int], prefer: Collection[int] = (),
             slack: int = 0) -> tuple[Entry | None, int, int]:
        """The stored state to restore for `prompt`, the rows to keep of it, and the
        longest prefix `prompt` shares with any stored text.

        A state can continue only where its text ends (a sliding-window model keeps
        just the last window of rows): it fits a prompt that starts with its whole
        text, and keeps all of it, or all but one row when the text is the whole
        prompt (the last prompt token must be evaluated, for its logits). A state that
        ends at one of `prefer` wins over longer ones that keep at most `slack` rows more.
        """
        best: Entry | None = None
        preferred: Entry | None = None
        best_n = shared_most = 0
        limit = len(prompt) - 1
        with self._lock:
            for entry in self._entries.values():
                tokens = entry.tokens
                shared = shared_prefix(tokens, prompt, limit + 1)
                if shared == len(tokens) and (entry.data is not None or entry.path is not None):
                    n = min(shared, limit)
                    if n > best_n:
                        best, best_n = entry, n
                    if n in prefer and (preferred is None or n > len(preferred.tokens)):
                        preferred = entry
                shared_most = max(shared_most, min(shared, limit))
        if preferred is not None and best_n - len(preferred.tokens) <= slack:
            return preferred, len(preferred.tokens), shared_most
        return best, best_n, shared_most

    def stored_prefix(self, tokens: list[int]) -> int:
        """The length of the longest stored text that `tokens` starts with (0: none),
        marking that state used: a prefix that keeps coming back stays in the store."""
        best: Entry | None = None
        with self._lock:
            for entry in self._entries.values():
                stored = entry.tokens
                if (len(stored) <= len(tokens) and (best is None or len(stored) > len(best.tokens))
                        and shared_prefix(stored, tokens, len(stored)) == len(stored)):
                    best = entry
            if best is None:
                return 0
            self._uses += 1
            best.used = self._uses
            return len(best.tokens)

    def put(self, tokens: list[int], data: bytearray) -> None:
        """Keep the state `data` of `tokens`: in RAM if it fits the budget, and on disk."""
        entry = Entry(tokens, state_name(tokens), len(data))
        to_disk = self.disk_budget >= entry.nbytes
        with self._lock:
            self.counters.saved += 1
            self._uses += 1
            entry.used = self._uses
            old = self._entries.pop(entry.name, None)
            if old is not None and old.data is not None:
                self.ram_bytes -= old.nbytes
            if old is not None and old.path is not None:
                # The same tokens: the file is rewritten in place.
                entry.path, entry.file_bytes = old.path, old.file_bytes
            if entry.nbytes <= self.ram_budget:
                entry.data = data
                self.ram_bytes += entry.nbytes
                self._trim_ram()
            if entry.data is None and not to_disk:
                return
            self._entries[entry.name] = entry
            if to_disk:
                entry.writing = True
                with self._flushed:
                    self._pending += 1
        if to_disk:
            self._writes.put(_Write(entry, data))

    def take_ram(self, entry: Entry) -> bytearray | None:
        """The entry's bytes if they are in RAM (marking it used)."""
        with self._lock:
            self._uses += 1
            entry.used = self._uses
            return entry.data

    def load(self, entry: Entry) -> Future[bytearray | None]:
        """Read the entry's file on the reader thread: its checked payload, or None."""
        return self._reader.submit(self._read, entry)

    def _trim_ram(self) -> None:
        """Drop the bytes of the least recently used states until RAM fits (lock held)."""
        if self.ram_bytes <= self.ram_budget:
            return
        for entry in sorted(self._entries.values(), key=lambda e: e.used):
            if self.ram_bytes <= self.ram_budget:
                break
            if entry.data is None:
                continue
            entry.data = None
            self.ram_bytes -= entry.nbytes
            self.counters.ram_evicted += 1
            if entry.path is None and not entry.writing:
                del self._entries[entry.name]

    # --- the store's thread --------------------------------------------------------------

    def _main(self, fingerprint: Callable[[], str]) -> None:
        try:
            self.fingerprint = fingerprint()
            if self.root is not None and self.disk_budget > 0:
                folder = self.root / self.fingerprint[:32]
                folder.mkdir(parents=True, exist_ok=True)
                self.folder = folder
                self._scan(folder)
        except OSError as exc:
            log.warning("prompt cache: no disk tier (%s: %s)", exc.filename, exc.strerror)
            self.folder = None
        except Exception:
            log.exception("prompt cache: no disk tier")
            self.folder = None
        finally:
            self._opened.set()
        while True:
            write = self._writes.get()
            if write is None:
                return
            if isinstance(write, Future):
                try:
                    write.set_result(self._clear())
                except Exception as exc:
                    log.exception("prompt cache: clearing failed")
                    write.set_exception(exc)
                continue
            try:
                self._write(write.entry, write.data)
            except Exception:
                log.exception("prompt cache: writing a state failed")
            finally:
                with self._lock:
                    entry = write.entry
                    entry.writing = False
                    if (entry.data is None and entry.path is None
                            and self._entries.get(entry.name) is entry):
                        del self._entries[entry.name]  # in neither tier: not written
                with self._flushed:
                    self._pending -= 1
                    self._flushed.notify_all()

    def _scan(self, folder: Path) -> None:
        """Index the states already on disk (headers only); drop foreign or short files."""
        found = 0
        for path in sorted(folder.glob("*" + _SUFFIX), key=_mtime):
            header = self._read_header(path)
            if header is None:
                continue
            tokens = array.array("i", header.tokens).tolist()
            entry = Entry(tokens, path.name, header.payload_bytes)
            entry.path, entry.file_bytes = path, _size(path)
            with self._lock:
                self._uses += 1
                entry.used = self._uses
                self._entries[entry.name] = entry
                self.disk_bytes += entry.file_bytes
            found += 1
        if found:
            log.info("prompt cache: %d states on disk in %s (%.1f MB)", found, folder,
                     self.disk_bytes / 1e6)

    def _read_header(self, path: Path) -> StateHeader | None:
        try:
            with path.open("rb") as file:
                head = file.read(len(_MAGIC) + _LENGTH)
                length = int.from_bytes(head[len(_MAGIC):], "little")
                if head[:len(_MAGIC)] != _MAGIC or len(head) != len(_MAGIC) + _LENGTH:
                    self._reject(path, "not a state file")
                    return None
                header = _header_decoder.decode(file.read(length))
                size = os.fstat(file.fileno()).st_size
        except FileNotFoundError:
            return None  # removed meanwhile (another daemon sharing the folder)
        except OSError as exc:
            self._reject(path, f"unreadable ({exc.strerror})")
            return None
        except msgspec.DecodeError:
            self._reject(path, "damaged header")
            return None
        if header.fingerprint != self.fingerprint:
            self._reject(path, "made by another model, llama.cpp build or layout")
            return None
        if size != len(_MAGIC) + _LENGTH + length + header.payload_bytes:
            self._reject(path, f"{size} bytes, not the {header.payload_bytes} "
                               "its header announces (truncated)")
            return None
        if path.name != state_name(array.array("i", header.tokens).tolist()):
            self._reject(path, "its name does not match its tokens")
            return None
        return header

    def _reject(self, path: Path, why: str) -> None:
        log.warning("prompt cache: ignoring and removing %s: %s", path, why)
        with self._lock:
            self.counters.errors += 1
        _unlink(path)

    def _read(self, entry: Entry) -> bytearray | None:
        """On the reader thread: the payload of the entry's file, checked, or None."""
        path = entry.path
        if path is None:
            return None
        header = self._read_header(path)
        data: bytearray | None = None
        if header is not None:
            data = bytearray(header.payload_bytes)
            try:
                with path.open("rb") as file:
                    file.seek(-header.payload_bytes, os.SEEK_END)
                    view = memoryview(data)
                    done = 0
                    while done < len(data):
                        n = file.readinto(view[done:done + _READ_CHUNK])
                        if not n:
                            break
                        done += n
                    view.release()
            except OSError:
                done = -1
            if done != len(data) or zlib.crc32(data) != header.payload_crc32:
                self._reject(path, "its payload does not match its checksum")
                data = None
            elif header.tokens != array.array("i", entry.tokens).tobytes():
                self._reject(path, "its tokens changed")
                data = None
            else:
                _touch(path)
        if data is None:
            self._forget(entry)
        return data

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if entry.path is not None:
                self.disk_bytes -= entry.file_bytes
                entry.path = None
            if entry.data is None and self._entries.get(entry.name) is entry:
                del self._entries[entry.name]

    def _write(self, entry: Entry, data: bytearray) -> None:
        folder = self.folder
        if folder is None:
            return
        header = _header_encoder.encode(StateHeader(
            fingerprint=self.fingerprint, tokens=array.array("i", entry.tokens).tobytes(),
            payload_bytes=len(data), payload_crc32=zlib.crc32(data)))
        size = len(_MAGIC) + _LENGTH + len(header) + len(data)
        if not self._make_room(folder, size, entry.name):
            return
        final = folder / entry.name
        # Another daemon sharing the folder only ever sees whole files: a temporary
        # name of its own, fsync, then an atomic rename.
        partial = folder / f".{entry.name}.{os.getpid()}.{threading.get_ident()}.partial"
        try:
            with partial.open("wb") as file:
                file.write(_MAGIC + len(header).to_bytes(_LENGTH, "little") + header)
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, final)
        except OSError as exc:
            _unlink(partial)
            log.warning("prompt cache: cannot write %s: %s", final, exc.strerror)
            with self._lock:
                self.counters.errors += 1
            return
        with self._lock:
            self.disk_bytes += size
            self.counters.written += 1
            current = self._entries.get(entry.name)
            if current is None:
                # Dropped from RAM before its file was there: back, as a disk state.
                current = self._entries[entry.name] = entry
            # (Replaced by a newer state of the same tokens: that one owns the file now.)
            current.path, current.file_bytes = final, size

    def _make_room(self, folder: Path, size: int, keep: str) -> bool:
        """Remove the least recently used files until `size` more bytes fit the budget.

        The folder is listed again each time, so files another daemon wrote count too.
        """
        if size > self.disk_budget:
            return False
        files = []
        total = 0
        for path in folder.iterdir():
            if path.name == keep:
                continue
            stat = _stat(path)
            if stat is None:
                continue
            files.append((stat.st_mtime_ns, path, stat.st_size))
            total += stat.st_size
        files.sort()
        stale = time.time_ns() - _STALE_PARTIAL_NS
        for mtime, path, file_size in files:
            if total + size <= self.disk_budget:
                break
            if path.name.startswith(".") and mtime > stale:
                continue  # another writer's file in progress
            _unlink(path)
            total -= file_size
            with self._lock:
                self.counters.disk_evicted += 1
                entry = self._entries.get(path.name)
                if entry is not None and entry.path == path:
                    entry.path = None
                    if entry.data is None:
                        del self._entries[entry.name]
        with self._lock:
            self.disk_bytes = total
        return total + size <= self.disk_budget

    def _clear(self) -> Cleared:
        """Forget every state and remove this store's files (the store's thread: every
        write queued before the clear is done; those queued after it are kept)."""
        with self._lock:
            gone = [entry for entry in self._entries.values() if not entry.writing]
            for entry in gone:
                del self._entries[entry.name]
            for entry in self._entries.values():
                entry.path, entry.file_bytes = None, 0  # its file is written again
            for entry in gone:
                # A reader loading one of these finds no path, or no file: the prompt
                # it was for is evaluated.
                entry.data, entry.path = None, None
            self.ram_bytes = sum(entry.nbytes for entry in self._entries.values()
                                 if entry.data is not None)
        files = removed = 0
        folder = self.folder
        if folder is not None:
            stale = time.time_ns() - _STALE_PARTIAL_NS
            for path in folder.iterdir():
                stat = _stat(path)
                if stat is None or (path.name.startswith(".") and stat.st_mtime_ns > stale):
                    continue  # another daemon's file in progress
                _unlink(path)
                files += 1
                removed += stat.st_size
        with self._lock:
            self.disk_bytes = 0
        log.info("prompt cache: cleared %d states, %d files (%.1f MB)", len(gone), files,
                 removed / 1e6)
        return Cleared(states=len(gone), files=files, bytes=removed)

    # --- the event loop (the stats and cache ops) ------------------------------------

    def clear(self) -> Future[Cleared]:
        """Forget every stored state and remove the files, on the store's thread after
        the writes already queued."""
        done: Future[Cleared] = Future()
        self._writes.put(done)
        return done

    def states(self, preview_tokens: int) -> list[StateView]:
        """Every stored state, most recently used first."""
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.used, reverse=True)
            return [StateView(tokens=entry.tokens[:preview_tokens], n_tokens=len(entry.tokens),
                              nbytes=entry.nbytes, ram=entry.data is not None,
                              disk=entry.path is not None or entry.writing)
                    for entry in entries]

    def figures(self) -> tuple[int, int, int, int]:
        """RAM bytes and states, disk bytes and files."""
        with self._lock:
            entries = list(self._entries.values())
            ram = sum(1 for entry in entries if entry.data is not None)
            files = sum(1 for entry in entries if entry.path is not None)
            return self.ram_bytes, ram, self.disk_bytes, files


def _mtime(path: Path) -> int:
    stat = _stat(path)
    return stat.st_mtime_ns if stat is not None else 0


def _size(path: Path) -> int:
    stat = _stat(path)
    return stat.st_size if stat is not None else 0


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _touch(path: Path) -> None:
    # The mtime is the disk tier's "last used": the least recently used go first.
    with contextlib.suppress(OSError):
        os.utime(path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def prompt_store(config: CacheConfig) -> PromptStore | None:
    """The store `[cache]` asks for; None when it is turned off."""
    if not config.enabled:
        return None
    return PromptStore(cache_folder(config), ram_budget_mb(config) << 20,
                       config.disk_mb << 20, config.min_tokens)


def cache_folder(config: CacheConfig) -> Path | None:
    """Where the disk tier lives; None without one."""
    if config.disk_mb == 0:
        return None
    if config.dir:
        return Path(os.path.expanduser(config.dir))
    return cache_dir() / "prompts"


def ram_budget_mb(config: CacheConfig) -> int:
    return config.ram_mb or default_ram_bytes() >> 20


def default_ram_bytes() -> int:
    """1/16 of the machine's memory, at most 2048 MB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 4 << 30
    return min(total // 16, 2048 << 20)


