"""The prompt store's index and RAM tier (the disk tier is disktier.DiskTier,
the threads promptstore.PromptStore): which stored state fits a prompt, and the RAM budget.

Memory: `ram_mb` bounds the bytes the store holds, the RAM tier's states and the states
queued for disk together, each buffer once (a slow disk or the model's first hash
cannot grow the write queue past it); a state that fits neither is not kept. A state
larger than the whole budget still goes to disk alone, when no other write is queued.

Pins: a state kept for a request's cache mark (Anthropic's `cache_control`) is pinned
for the mark's TTL, which each use restarts. Both tiers evict pinned states only after
every unpinned one; a pin that ran out leaves an ordinary state.

The decode thread calls `find`, `stored_prefix`, `put`, `pin` and `take_ram`: no I/O,
no logging, a lock held for microseconds.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from pathlib import Path

import msgspec

from sfcore_daemon.llama.kvcache import shared_prefix
from sfcore_daemon.store.statefile import state_name


class Entry:
    """One stored state: its tokens, and where its bytes are (RAM, disk, or both)."""

    __slots__ = ("tokens", "name", "nbytes", "data", "path", "file_bytes", "used", "writing",
                 "pin_s", "pinned_until")

    def __init__(self, tokens: list[int], name: str, nbytes: int) -> None:
        self.tokens = tokens
        self.name = name
        self.nbytes = nbytes
        self.data: bytearray | None = None  # in the RAM tier
        self.path: Path | None = None
        self.file_bytes = 0
        self.used = 0  # the store's use counter when last saved or restored
        # Queued for the disk tier: the write holds the bytes, counted against the RAM
        # budget, even once the RAM tier dropped them.
        self.writing = False
        # A cache mark's pin: its TTL, and the clock reading it holds until (0: none).
        self.pin_s = 0.0
        self.pinned_until = 0.0

    def pinned(self, now: float) -> bool:
        return self.pinned_until > now

    def use(self, now: float) -> None:
        """Restart its pin's TTL (Anthropic's marks live that long from their last use)."""
        if self.pin_s:
            self.pinned_until = max(self.pinned_until, now + self.pin_s)


class CacheCounters(msgspec.Struct, kw_only=True):
    """What the store did since start (the `stats` op adds the hits it counts)."""

    saved: int = 0  # states taken from a slot
    written: int = 0  # files written
    ram_evicted: int = 0
    disk_evicted: int = 0
    errors: int = 0  # unreadable, damaged or foreign files, failed writes and restores
    # States neither tier took: the RAM budget was held by states still being written.
    dropped: int = 0


class _Write:
    """A state on its way to disk; it holds the bytes the RAM tier may drop first."""

    __slots__ = ("entry", "data")

    def __init__(self, entry: Entry, data: bytearray) -> None:
        self.entry = entry
        self.data: bytearray | None = data


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
    pinned_s: int = 0  # seconds its cache mark's pin has left (0: not pinned)


class PromptIndex:
    """The stored states by name, and the RAM tier, bounded; the base of PromptStore."""

    def __init__(self, directory: Path | None, ram_bytes: int, disk_bytes: int,
                 min_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = directory
        self.clock = clock
        self.ram_budget = ram_bytes
        self.disk_budget = disk_bytes if directory is not None else 0
        self.min_tokens = min_tokens
        self.counters = CacheCounters()
        self.folder: Path | None = None  # root / fingerprint, once known
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._uses = 0
        self.ram_bytes = 0  # the RAM tier's
        self.held_bytes = 0  # the RAM tier's and the queued writes' (each buffer once)
        self.disk_bytes = 0
        self._writes: queue.SimpleQueue[_Write | Future[Cleared] | None] = queue.SimpleQueue()
        self._flushed = threading.Condition()
        self._pending = 0  # writes queued and not yet done
        self._pending_bytes = 0  # their states' bytes
        self._opened = threading.Event()

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
            best.use(self.clock())
            return len(best.tokens)

    def stored_already(self, tokens: list[int], gain: int | None = None) -> bool:
        """Whether a state of `tokens` would add too little to keep: a stored text they
        start with ends fewer than `gain` (min_tokens) tokens before them."""
        return len(tokens) - self.stored_prefix(tokens) < (
            self.min_tokens if gain is None else gain)

    def put(self, tokens: list[int], data: bytearray, pin_s: float = 0.0) -> bool:
        """Keep the state `data` of `tokens`: in RAM if it fits the budget, and on disk;
        pinned for `pin_s` seconds if given. Whether it was kept.

        The RAM tier and the writes queued share the RAM budget: a state that finds it
        held by states still being written is not kept (a slow or hung disk never grows
        the queue past it), except that a state larger than the whole budget goes to
        disk alone when nothing else is queued."""
        entry = Entry(tokens, state_name(tokens), len(data))
        size = entry.nbytes
        with self._lock:
            self.counters.saved += 1
            self._uses += 1
            entry.used = self._uses
            entry.pin_s = pin_s
            to_disk = self.disk_budget >= size and not (self._opened.is_set()
                                                        and self.folder is None)
            old = self._entries.pop(entry.name, None)
            if old is not None:
                self._drop_ram(old)
                entry.pin_s = max(entry.pin_s, old.pin_s)  # a longer pin of the tokens holds
                entry.pinned_until = old.pinned_until
                # The same tokens: the file is rewritten in place.
                entry.path, entry.file_bytes = old.path, old.file_bytes
            entry.use(self.clock())
            if size <= self.ram_budget:
                self._trim_ram(size)
            if self.held_bytes + size <= self.ram_budget:
                entry.data = data
                self.ram_bytes += size
            elif not to_disk or self._pending:
                self.counters.dropped += 1
                if old is not None and old.path is not None:
                    self._entries[old.name] = old  # its file still serves
                    old.pin_s, old.pinned_until = entry.pin_s, entry.pinned_until
                    return True
                return False
            self.held_bytes += size
            self._entries[entry.name] = entry
            if to_disk:
                entry.writing = True
                with self._flushed:
                    self._pending += 1
                    self._pending_bytes += size
        if to_disk:
            self._writes.put(_Write(entry, data))
        return True

    def pin(self, tokens: list[int], pin_s: float) -> bool:
        """Pin the stored state of exactly `tokens` for `pin_s` seconds from now (a
        longer pin it has stays); False if there is none."""
        with self._lock:
            entry = self._entries.get(state_name(tokens))
            if entry is None or entry.tokens != tokens:
                return False
            self._uses += 1
            entry.used = self._uses
            entry.pin_s = max(entry.pin_s, pin_s)
            entry.use(self.clock())
            return True

    def take_ram(self, entry: Entry) -> bytearray | None:
        """The entry's bytes if they are in RAM (marking it used: its pin restarts)."""
        with self._lock:
            self._uses += 1
            entry.used = self._uses
            entry.use(self.clock())
            return entry.data

    def pinned_names(self) -> frozenset[str]:
        """The states pinned now (the disk tier removes their files last)."""
        now = self.clock()
        with self._lock:
            return frozenset(name for name, entry in self._entries.items()
                             if entry.pinned(now))

    def _trim_ram(self, room: int) -> None:
        """Drop the bytes of the least recently used states until `room` more bytes fit
        the budget (lock held), pinned states only after every unpinned one. Only states
        no queued write holds free memory, and nothing is dropped unless that makes the
        room."""
        need = self.held_bytes + room - self.ram_budget
        if need <= 0:
            return
        now = self.clock()
        droppable = sorted((entry for entry in self._entries.values()
                            if entry.data is not None and not entry.writing),
                           key=lambda e: (e.pinned(now), e.used))
        if sum(entry.nbytes for entry in droppable) < need:
            return
        for entry in droppable:
            if need <= 0:
                break
            self._drop_ram(entry)
            need -= entry.nbytes
            self.counters.ram_evicted += 1
            if entry.path is None:
                del self._entries[entry.name]

    def _drop_ram(self, entry: Entry) -> None:
        """Take `entry` out of the RAM tier (lock held); its bytes stay held while a
        queued write still needs them."""
        if entry.data is None:
            return
        entry.data = None
        self.ram_bytes -= entry.nbytes
        if not entry.writing:
            self.held_bytes -= entry.nbytes

    # --- the event loop (the stats and cache ops) ------------------------------------

    def states(self, preview_tokens: int) -> list[StateView]:
        """Every stored state, most recently used first."""
        now = self.clock()
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.used, reverse=True)
            return [StateView(tokens=entry.tokens[:preview_tokens], n_tokens=len(entry.tokens),
                              nbytes=entry.nbytes, ram=entry.data is not None,
                              disk=entry.path is not None or entry.writing,
                              pinned_s=max(0, math.ceil(entry.pinned_until - now)))
                    for entry in entries]

    def figures(self) -> tuple[int, int, int, int]:
        """RAM bytes (the RAM tier's and the queued writes') and states, disk bytes and
        files."""
        with self._lock:
            entries = list(self._entries.values())
            ram = sum(1 for entry in entries if entry.data is not None)
            files = sum(1 for entry in entries if entry.path is not None)
            return self.held_bytes, ram, self.disk_bytes, files
