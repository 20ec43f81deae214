"""The prompt store's folders on disk: which files count against the disk budget, and
removing them without removing what is not ours or what changed under us.

Under `[cache] dir` each fingerprint (fingerprint.py) has its own folder, named by its
first 32 hex digits. An upgrade, another model or another context layout starts a new
folder and never reads the old ones, so the budget is over all of them: files of other
fingerprints are removed first, oldest first, and a folder left empty is removed too.
Anything else under `dir` (a file, a folder of another name, a link) is not the store's
and is neither counted nor touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

# A temporary file older than this is a crashed writer's leftover, and may be removed.
_STALE_PARTIAL_NS = 3600 * 10**9
_FOLDER = re.compile(r"[0-9a-f]{32}")


class StoredFile(NamedTuple):
    own: bool  # in this store's folder (else another fingerprint's)
    mtime_ns: int  # the last write or restore: the least recently used go first
    path: Path
    size: int


def folder_name(fingerprint: str) -> str:
    return fingerprint[:32]


def stored_files(root: Path, own: Path) -> list[StoredFile]:
    """Every regular file in the fingerprint folders under `root`, `own` included,
    in the order they are removed to make room: other fingerprints' first, then the
    least recently used."""
    folders = [own]
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            path = root / name
            if path != own and _FOLDER.fullmatch(name) and _is_dir(path):
                folders.append(path)
    found = []
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            path = folder / name
            info = lstat(path)
            if info is not None and stat.S_ISREG(info.st_mode):
                found.append(StoredFile(folder == own, info.st_mtime_ns, path, info.st_size))
    found.sort(key=lambda f: (f.own, f.mtime_ns))
    return found


class Room(NamedTuple):
    fits: bool  # the new file fits now
    own_bytes: int  # what this store's folder holds, the new file and `keep` left out
    removed: list[Path]  # this store's files removed for the room
    evicted: int  # files removed, of every folder


def make_room(root: Path, own: Path, size: int, budget: int, keep: str, *,
              pinned: Collection[str] = ()) -> Room:
    """Remove files until `size` more bytes fit `budget`: other fingerprints' first,
    then the least recently used, this store's `pinned` ones (cache marks) last. `keep`
    (the name of the file about to be replaced) is neither counted nor removed; neither
    are other writers' files in progress."""
    files = [file for file in stored_files(root, own)
             if not (file.own and file.path.name == keep)]
    if pinned:
        files.sort(key=lambda file: file.own and file.path.name in pinned)
    total = sum(file.size for file in files)
    own_bytes = sum(file.size for file in files if file.own)
    now = time.time_ns()
    removed: list[Path] = []
    emptied: set[Path] = set()
    evicted = 0
    for file in files:
        if total + size <= budget:
            break
        if in_progress(file, now) or not unlink(file.path):
            continue  # another writer's file in progress, or gone already
        total -= file.size
        evicted += 1
        if file.own:
            own_bytes -= file.size
            removed.append(file.path)
        else:
            emptied.add(file.path.parent)
    for folder in emptied:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return Room(total + size <= budget, own_bytes, removed, evicted)


def remove_own(root: Path, own: Path) -> tuple[int, int]:
    """Remove this store's files, but for other writers' files in progress: how many
    files, and their bytes."""
    files = removed = 0
    now = time.time_ns()
    for file in stored_files(root, own):
        if file.own and not in_progress(file, now) and unlink(file.path):
            files += 1
            removed += file.size
    return files, removed


def remove_if_same(path: Path, info: os.stat_result, lock: threading.Lock) -> bool:
    """Remove the file at `path` if it is still the one `info` was taken of: one
    written there since (by a writer that replaces files holding `lock`) is kept."""
    with lock:
        return same_file(path, info) and unlink(path)


def in_progress(file: StoredFile, now_ns: int) -> bool:
    """Another writer's temporary file, being written now (not a crashed one's)."""
    return file.path.name.startswith(".") and file.mtime_ns > now_ns - _STALE_PARTIAL_NS


def lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def same_file(path: Path, info: os.stat_result) -> bool:
    """Whether `path` is still the file `info` was taken of (not replaced since)."""
    now = lstat(path)
    return now is not None and (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def touch(path: Path) -> None:
    # The mtime is the disk tier's "last used": the least recently used go first.
    with contextlib.suppress(OSError):
        os.utime(path, follow_symlinks=False)


def unlink(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _is_dir(path: Path) -> bool:
    info = lstat(path)
    return info is not None and stat.S_ISDIR(info.st_mode)
