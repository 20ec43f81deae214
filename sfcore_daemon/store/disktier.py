"""The prompt store's disk tier: the files of one fingerprint's folder, what the index
knows of them, and the disk budget (the threads that do this work are
promptstore.PromptStore's).

A file carries the fingerprint of everything that decides its rows' layout and numbers
(fingerprint.py): files live in a folder named after it, and a file whose header names
another fingerprint is never loaded. Every file is checked before a byte of it is
trusted (statefile.py): a damaged, truncated or foreign one is skipped with one warning
naming it and why (and removed where that is safe), never restored, and never turns the
disk tier off. The disk budget is over every fingerprint's folder (disk.py).

Everything here runs on the store's thread, except `_check` and `_forget`, which the
reader thread calls too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from sfcore_daemon.store import disk, statefile
from sfcore_daemon.store.index import Cleared, Entry, PromptIndex
from sfcore_daemon.store.statefile import BadStateFile, StateHeader

# A file is checksummed and written in parts of this size, each when the writer is let.
_WRITE_PART = 4 << 20

# The prompt store's lines keep the one logger name they had before the split.
log = logging.getLogger("sfcore_daemon.store.promptstore")


class DiskTier(PromptIndex):
    """The stored states' files in one folder on disk (bounded); the base of PromptStore."""

    def __init__(self, directory: Path | None, ram_bytes: int, disk_bytes: int,
                 min_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(directory, ram_bytes, disk_bytes, min_tokens, clock)
        self.fingerprint = ""
        # Held while a file is replaced (the store's thread) or removed after a failed
        # read (the reader): a bad read never removes a file written meanwhile.
        self._files = threading.Lock()
        self._write_trouble = ""  # the last write failure's reason, warned once

    def _open_disk(self, fingerprint: Callable[[], str]) -> None:
        """Work out the fingerprint, make its folder and index the files there."""
        try:
            self.fingerprint = fingerprint()
            if self.root is not None and self.disk_budget > 0:
                folder = self.root / disk.folder_name(self.fingerprint)
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
            info = disk.lstat(path)
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
            if exc.info is not None and disk.remove_if_same(path, exc.info, self._files):
                log.warning("prompt cache: ignoring and removing %s: %s", path, exc.reason)
            else:
                log.warning("prompt cache: ignoring %s: %s", path, exc.reason)
            return None


    def _forget(self, entry: Entry) -> None:
        with self._lock:
            if entry.path is not None:
                self.disk_bytes -= entry.file_bytes
                entry.path = None
            if entry.data is None and not entry.writing \
                    and self._entries.get(entry.name) is entry:
                del self._entries[entry.name]

    def _write(self, entry: Entry, data: bytearray, ready: Callable[[], None] = lambda: None
               ) -> None:
        """Write the state's file; `ready` is called before its checksum and before each
        part of it is written (it may wait for a better moment)."""
        folder = self.folder
        if folder is None:
            return
        crc = 0
        with memoryview(data) as view:
            for start in range(0, len(data), _WRITE_PART):
                ready()
                crc = zlib.crc32(view[start:start + _WRITE_PART], crc)
        head = statefile.encode(self.fingerprint, entry.tokens, data, crc)
        size = len(head) + len(data)
        final = folder / entry.name
        # Temporary name, then atomic rename: a daemon sharing the folder sees whole files.
        # No fsync: the CRC catches torn files; fsync slowed decoding (performance/prompt-store.md).
        partial = folder / f".{entry.name}.{os.getpid()}.{threading.get_ident()}.partial"
        try:
            folder.mkdir(parents=True, exist_ok=True)  # removed while running: made again
            if not self._make_room(size, entry.name):
                return
            with partial.open("wb") as file, memoryview(data) as view:
                file.write(head)
                for start in range(0, len(data), _WRITE_PART):
                    if start:
                        ready()
                    file.write(view[start:start + _WRITE_PART])
            with self._files:
                os.replace(partial, final)
        except OSError as exc:
            disk.unlink(partial)
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
        """Remove files until `size` more bytes fit the disk budget (disk.make_room:
        other fingerprints' folders first). The folders are listed again each time, so
        files another daemon wrote count too."""
        root, folder = self.root, self.folder
        if size > self.disk_budget or root is None or folder is None:
            return False
        room = disk.make_room(root, folder, size, self.disk_budget, keep,
                              pinned=self.pinned_names())
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
            files, removed = disk.remove_own(root, folder)
        with self._lock:
            self.disk_bytes = 0
        log.info("prompt cache: cleared %d states, %d files (%.1f MB)", len(gone), files,
                 removed / 1e6)
        return Cleared(states=len(gone), files=files, bytes=removed)

