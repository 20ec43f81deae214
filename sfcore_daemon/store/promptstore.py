"""Prompt states kept after their slot lets them go: a RAM tier and a disk tier, and the
store's threads.

A state is what `llama_state_seq_get_data` returns for one sequence: the K and V rows
of its cells, position by position. Restoring it (kvcache.KVCache.restore) puts the
same rows back, so a long prefix is read in milliseconds instead of evaluated again.

Each state is stored with the exact tokens its cells hold (the index and the RAM tier,
with its budget: index.py). The disk tier (disktier.py) keeps them in files under a
folder named after the fingerprint (fingerprint.py), each checked before it is trusted
(statefile.py), within a disk budget over every fingerprint's folder (disk.py).

Threads: the decode thread calls `find`, `stored_prefix`, `put`, `take_ram`, `load` and
`read_overdue` (no I/O, no logging: a lock held for microseconds); the store's own
thread hashes the model, scans the folder, then writes files at idle priority
(system/background.py) while the decode thread waits for work (`engine_idle`); a reader
thread loads
files for the decode thread, which gives up on a read that takes longer than
`[cache] disk_read_timeout_ms` (engine/storepolicy.py).
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
from sfcore_daemon.store import disk
from sfcore_daemon.store.disktier import DiskTier
from sfcore_daemon.store.index import CacheCounters, Cleared, Entry, StateView
from sfcore_daemon.store.statefile import StateHeader, state_name
from sfcore_daemon.system.background import run_when_idle

__all__ = ["CacheCounters", "Cleared", "Entry", "PromptStore", "StateHeader", "StateView",
           "prompt_store", "state_name"]

log = logging.getLogger(__name__)

# Test hooks (SFCORE_FAILPOINT): a disk whose reads or writes hang until the store closes.
_READ_HANG = "disk_read_hang"
_WRITE_HANG = "disk_write_hang"
_HANG_S = 3600.0


class PromptStore(DiskTier):
    """States of long prefixes in RAM (bounded) and in one folder on disk (bounded).

    `open` starts the store's thread: it works out the fingerprint (which may hash the
    model file once) and reads the headers of the files already there; until then the
    disk tier is empty and the RAM tier works as usual.
    """

    def __init__(self, directory: Path | None, ram_bytes: int, disk_bytes: int,
                 min_tokens: int, read_timeout_s: float = 5.0) -> None:
        super().__init__(directory, ram_bytes, disk_bytes, min_tokens)
        self.read_timeout_s = read_timeout_s
        self._thread: threading.Thread | None = None
        self._reads: queue.SimpleQueue[tuple[Entry, Future[bytearray | None]] | None] = \
            queue.SimpleQueue()
        self._read_since: float | None = None  # when the read in progress began
        self._closing = threading.Event()
        # Set while the decode thread waits for work: the files are written then.
        self._engine_idle = threading.Event()
        self._engine_idle.set()
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
        self._engine_idle.set()  # wakes a write waiting for it
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

    def engine_idle(self, idle: bool) -> None:
        """The decode thread has no work (`idle`), or has some again."""
        if idle:
            self._engine_idle.set()
        elif not self._closing.is_set():
            self._engine_idle.clear()

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
            self._open_disk(fingerprint)
        finally:
            self._opened.set()
        # The writes (and clears) that follow wait for a core the decode leaves idle;
        # the fingerprint above did not: the disk tier serves nothing until it is done.
        log.debug("prompt cache: the writer thread runs at %s", run_when_idle() or
                  "normal priority")
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
                self._write(entry, data, self._wait_idle)
            except Exception:
                log.exception("prompt cache: writing a state failed")
            finally:
                del data
                self._written(entry)

    def _wait_idle(self) -> None:
        """Before each part of a file: wait until the decode thread is idle. On a
        machine whose cores the decode holds, a write beside it slowed every step
        (the writer's GIL, the kernel's copy), whatever the writer's priority
        (docs/performance/prompt-store.md). Not while the queued writes hold half the
        RAM budget: under steady load files still get written, and the RAM tier keeps
        taking states. No deadline: files written beside warm turns slowed their decode."""
        while not self._engine_idle.is_set():
            if self._pending_bytes * 2 >= self.ram_budget:
                return
            self._engine_idle.wait(1.0)

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
            self._pending_bytes -= entry.nbytes
            self._flushed.notify_all()

    # --- the reader thread --------------------------------------------------------------

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
        disk.touch(path)
        return checked[2]

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
