"""Prompt states kept after their slot lets them go: a RAM tier and a disk tier.

A state is what `llama_state_seq_get_data` returns for one sequence: the K and V rows
of its cells, position by position. Restoring it (kvcache.KVCache.restore) puts the
same rows back, so a long prefix is read in milliseconds instead of evaluated again.

Each state is stored with the exact tokens its cells hold (the index and the RAM tier,
with its budget: promptindex.py). A file on disk also carries the fingerprint of
everything that decides the rows' layout and numbers (the model file's sha256, the
llama.cpp build, the context parameters, the CPU features): files live in a folder
named after it, and a file whose header names another fingerprint is never loaded.
Every file is checked before a byte of it is trusted (statefile.py): a damaged,
truncated or foreign one is skipped with one warning naming it and why (and removed
where that is safe), never restored, and never turns the disk tier off. The disk
budget is over every fingerprint's folder (statedisk.py).

Threads: the decode thread calls `find`, `stored_prefix`, `put`, `take_ram`, `load` and
`read_overdue` (no I/O, no logging: a lock held for microseconds); the store's own
thread hashes the model, scans the folder and writes files; a reader thread loads
files for the decode thread, which gives up on a read that takes longer than
`[cache] disk_read_timeout_ms` (promptstates.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from sfcore_daemon.config import CacheConfig
from sfcore_daemon.llama.modelfile import cache_dir
from sfcore_daemon.store import disk as statedisk
from sfcore_daemon.store import statefile
from sfcore_daemon.store.index import CacheCounters, Cleared, Entry, PromptIndex, StateView
from sfcore_daemon.store.statefile import BadStateFile, StateHeader, state_name

__all__ = ["CacheCounters", "Cleared", "Entry", "PromptStore", "StateHeader", "StateView",
           "prompt_store", "state_name"]

log = logging.getLogger(__name__)

# Test hooks (SFCORE_FAILPOINT): a disk whose reads or writes hang until the store closes.
_READ_HANG = "disk_read_hang"
_WRITE_HANG = "disk_write_hang"
_HANG_S = 3600.0


class PromptStore(PromptIndex):
    """States of long prefixes in RAM (bounded) and in one folder on disk (bounded).

    `open` starts the store's thread: it works out the fingerprint (which may hash the
    model file once) and reads the headers of the files already there; until then the
    disk tier is empty and the RAM tier works as usual.
    """

    def __init__(self, directory: Path | None, ram_bytes: int, disk_bytes: int,
                 min_tokens: int, read_timeout_s: float = 5.0) -> None:
        super().__init__(directory, ram_bytes, disk_bytes, min_tokens)
        self.read_timeout_s = read_timeout_s
        self.fingerprint = ""
        self._thread: threading.Thread | None = None
        self._reads: queue.SimpleQueue[tuple[Entry, Future[bytearray | None]] | None] = \
            queue.SimpleQueue()
        self._read_since: float | None = None  # when the read in progress began
        # Held while a file is replaced (the store's thread) or removed after a failed
        # read (the reader): a bad read never removes a file written meanwhile.
        self._files = threading.Lock()
        self._closing = threading.Event()
        self._write_trouble = ""  # the last write failure's reason, warned once
        self._failpoint = os.environ.get("SFCORE_FAILPOINT", "")

    # --- lifetime -------------------------------------------------------------------

    def open(self, fingerprint: Callable[[], str]) -> None:
        """Start the store's thread; `fingerprint` runs on it (it may hash the model)."""
        self._thread = threading.Thread(target=self._main, args=(fingerprint,),
                                        name="sfcore-cache", daemon=True)
        self._thread.start()
        # A daemon thread: a read stuck on a hung disk must not hold the exit.
        threading.Thread(target=self._reader, name="sfcore-cache-read", daemon=True).start()

    def wait_open(self, timeout: float) -> bool:
        """Wait until the folder is indexed (or the store found it cannot have one)."""
        return self._opened.wait(timeout)

    def close(self, timeout: float) -> bool:
        """Write what is queued (at most `timeout` seconds), then stop the threads."""
        deadline = time.monotonic() + timeout
        self._closing.set()
        flushed = self.flush(timeout)
        self._writes.put(None)
        self._reads.put(None)
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        return flushed

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write is done; False if `timeout` ran out first."""
        with self._flushed:
            return self._flushed.wait_for(lambda: self._pending == 0, timeout)

    # --- the decode thread ------------------------------------------------------------

    def load(self, entry: Entry) -> Future[bytearray | None]:
        """Read the entry's file on the reader thread: its checked payload, or None.
        (A read still queued when its caller gives up is cancelled: `Future.cancel`.)"""
        read: Future[bytearray | None] = Future()
        self._reads.put((entry, read))
        return read

    def read_overdue(self) -> bool:
        """Whether the reader has been on one read for longer than the read timeout: a
        hung disk. Until that read returns, restores skip the disk tier rather than
        queue behind it."""
        since = self._read_since
        return since is not None and time.monotonic() - since > self.read_timeout_s

    def read_abandoned(self) -> None:
        """A read took longer than the timeout and its prompt was evaluated instead."""
        with self._lock:
            self.counters.errors += 1

    # --- the store's thread --------------------------------------------------------------

    def _main(self, fingerprint: Callable[[], str]) -> None:
        try:
            self.fingerprint = fingerprint()
            if self.root is not None and self.disk_budget > 0:
                folder = self.root / statedisk.folder_name(self.fingerprint)
                folder.mkdir(parents=True, exist_ok=True)
                self.folder = folder
        except OSError as exc:
            log.warning("prompt cache: no disk tier (%s: %s)", exc.filename, exc.strerror)
            self.folder = None
        except Exception:
            log.exception("prompt cache: no disk tier")
            self.folder = None
        try:
            if self.folder is not None:
                self._scan(self.folder)
                self._make_room(0, "")  # a lower disk_mb, or old fingerprints' folders
        except Exception:  # a bug: the files found so far serve, and writes go on
            log.exception("prompt cache: reading %s failed", self.folder)
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
            entry, data = write.entry, write.data
            write.data = None  # freed once written: the budget no longer counts it
            try:
                if self._failpoint == _WRITE_HANG:
                    self._closing.wait(_HANG_S)
                assert data is not None
                self._write(entry, data)
            except Exception:
                log.exception("prompt cache: writing a state failed")
            finally:
                del data
                self._written(entry)

    def _written(self, entry: Entry) -> None:
        """Its write is done (or failed): its bytes are held only if in the RAM tier."""
        with self._lock:
            entry.writing = False
            if entry.data is None:
                self.held_bytes -= entry.nbytes
                if entry.path is None and self._entries.get(entry.name) is entry:
                    del self._entries[entry.name]  # in neither tier: not written
        with self._flushed:
            self._pending -= 1
            self._flushed.notify_all()

    def _scan(self, folder: Path) -> None:
        """Index the states already on disk (headers only), least recently used first;
        skip, and where safe remove, files that are not this store's states."""
        try:
            names = os.listdir(folder)
        except OSError as exc:
            log.warning("prompt cache: cannot list %s: %s", folder, exc.strerror)
            return
        found = []
        for name in names:
            path = folder / name
            info = statedisk.lstat(path)
            if name.endswith(statefile.SUFFIX) and not name.startswith(".") and info:
                found.append((info.st_mtime_ns, path))
        found.sort()
        indexed = 0
        for _, path in found:
            checked = self._check(path, payload=False)
            if checked is None:
                continue
            header, size, _ = checked
            entry = Entry(statefile.tokens_of(header), path.name, header.payload_bytes)
            entry.path, entry.file_bytes = path, size
            with self._lock:
                self._uses += 1
                entry.used = self._uses
                # (A state of the same tokens saved meanwhile is newer: it is written
                # over this file.)
                self._entries.setdefault(entry.name, entry)
                self.disk_bytes += entry.file_bytes
            indexed += 1
        if indexed:
            log.info("prompt cache: %d states on disk in %s (%.1f MB)", indexed, folder,
                     self.disk_bytes / 1e6)

    def _check(self, path: Path, *, payload: bool
               ) -> tuple[StateHeader, int, bytearray | None] | None:
        """statefile.read_state; a bad file gets one warning naming it and why, and is
        removed if it is still the file read (a state written there meanwhile is a
        good one) and removing it is safe (a regular file)."""
        try:
            return statefile.read_state(path, self.fingerprint, self.disk_budget,
                                        payload=payload)
        except BadStateFile as exc:
            with self._lock:
                self.counters.errors += 1
            if exc.info is not None and statedisk.remove_if_same(path, exc.info, self._files):
                log.warning("prompt cache: ignoring and removing %s: %s", path, exc.reason)
            else:
                log.warning("prompt cache: ignoring %s: %s", path, exc.reason)
            return None

    def _reader(self) -> None:
        """The reader thread: one read at a time, in the order asked."""
        while True:
            job = self._reads.get()
            if job is None:
                return
            entry, read = job
            del job
            if not read.set_running_or_notify_cancel():
                continue  # given up before it began
            self._read_since = time.monotonic()
            try:
                read.set_result(self._read(entry))
            except BaseException as exc:  # the decode thread evaluates the prompt instead
                read.set_exception(exc)
            finally:
                self._read_since = None
                del read  # its bytes belong to the decode thread, or to no one

    def _read(self, entry: Entry) -> bytearray | None:
        """On the reader thread: the payload of the entry's file, checked, or None."""
        path = entry.path
        if path is None:
            return None
        if self._failpoint == _READ_HANG:
            self._closing.wait(_HANG_S)
        checked = self._check(path, payload=True)
        if checked is None:
            self._forget(entry)
            return None
        statedisk.touch(path)
        return checked[2]

    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if entry.path is not None:
                self.disk_bytes -= entry.file_bytes
                entry.path = None
            if entry.data is None and not entry.writing \
                    and self._entries.get(entry.name) is entry:
                del self._entries[entry.name]

    def _write(self, entry: Entry, data: bytearray) -> None:
        folder = self.folder
        if folder is None:
            return
        head = statefile.encode(self.fingerprint, entry.tokens, data)
        size = len(head) + len(data)
        final = folder / entry.name
        # Another daemon sharing the folder only ever sees whole files: a temporary
        # name of its own, fsync, then an atomic rename.
        partial = folder / f".{entry.name}.{os.getpid()}.{threading.get_ident()}.partial"
        try:
            folder.mkdir(parents=True, exist_ok=True)  # removed while running: made again
            if not self._make_room(size, entry.name):
                return
            with partial.open("wb") as file:
                file.write(head)
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            with self._files:
                os.replace(partial, final)
        except OSError as exc:
            statedisk.unlink(partial)
            self._write_failed(final, exc)
            return
        if self._write_trouble:
            log.info("prompt cache: writing to %s again", folder)
            self._write_trouble = ""
        with self._lock:
            self.disk_bytes += size
            self.counters.written += 1
            current = self._entries.get(entry.name)
            if current is None:
                # Dropped from RAM before its file was there: back, as a disk state.
                current = self._entries[entry.name] = entry
            # (Replaced by a newer state of the same tokens: that one owns the file now.)
            current.path, current.file_bytes = final, size

    def _write_failed(self, path: Path, exc: OSError) -> None:
        """One warning per kind of failure (a full disk, a read-only folder), not one
        per state, until a write works again."""
        with self._lock:
            self.counters.errors += 1
        reason = exc.strerror or str(exc)
        if reason != self._write_trouble:
            log.warning("prompt cache: cannot write %s: %s (states stay in RAM only "
                        "until writes work again)", path, reason)
            self._write_trouble = reason

    def _make_room(self, size: int, keep: str) -> bool:
        """Remove files until `size` more bytes fit the disk budget (statedisk.make_room:
        other fingerprints' folders first). The folders are listed again each time, so
        files another daemon wrote count too."""
        root, folder = self.root, self.folder
        if size > self.disk_budget or root is None or folder is None:
            return False
        room = statedisk.make_room(root, folder, size, self.disk_budget, keep)
        with self._lock:
            self.counters.disk_evicted += room.evicted
            for path in room.removed:
                entry = self._entries.get(path.name)
                if entry is not None and entry.path == path:
                    entry.path = None
                    if entry.data is None and not entry.writing:
                        del self._entries[entry.name]
            self.disk_bytes = room.own_bytes
        return room.fits

    def _clear(self) -> Cleared:
        """Forget every state and remove this store's files (the store's thread: every
        write queued before the clear is done; those queued after it are kept)."""
        with self._lock:
            gone = [entry for entry in self._entries.values() if not entry.writing]
            for entry in gone:
                del self._entries[entry.name]
                # A reader loading one of these finds no path, or no file: the prompt
                # it was for is evaluated.
                self._drop_ram(entry)
                entry.path = None
            for entry in self._entries.values():
                entry.path, entry.file_bytes = None, 0  # its file is written again
        files = removed = 0
        folder, root = self.folder, self.root
        if folder is not None and root is not None:
            files, removed = statedisk.remove_own(root, folder)
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


def prompt_store(config: CacheConfig) -> PromptStore | None:
    """The store `[cache]` asks for; None when it is turned off."""
    if not config.enabled:
        return None
    return PromptStore(cache_folder(config), ram_budget_mb(config) << 20,
                       config.disk_mb << 20, config.min_tokens,
                       config.disk_read_timeout_ms / 1000)


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
