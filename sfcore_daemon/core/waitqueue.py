"""The order of the wait queue: interactive requests before background ones.

`WaitQueue` holds the generations waiting for a slot in the order they are to start:
interactive ones first, then background ones, each class in arrival order. Each time
an interactive request that arrived later starts while a background one waits, that
one is passed; once passed MAX_PASSES times it waits as an interactive request of its
own arrival, ahead of those that came after it. So background work is put off, never
starved. Which request can start, and when, is the scheduler's business.
Event loop only.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Final

from sfcore_daemon.core.generation import Generation

# How often later interactive requests may start ahead of a waiting background one.
MAX_PASSES: Final = 8


class _Waiting:
    """One waiting generation and its place: its arrival, its class, its passes."""

    __slots__ = ("generation", "arrival", "background", "passed")

    def __init__(self, generation: Generation, arrival: int) -> None:
        self.generation = generation
        self.arrival = arrival
        self.background = generation.job.priority == "background"
        self.passed = 0

    def key(self) -> tuple[bool, int]:
        return self.background, self.arrival


class WaitQueue:
    """The waiting generations, in the order they are to start."""

    def __init__(self) -> None:
        self._order: list[_Waiting] = []
        self._entries: dict[Generation, _Waiting] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Generation]:
        return iter([entry.generation for entry in self._order])

    @property
    def head(self) -> Generation:
        """The generation to start next; IndexError when none waits."""
        return self._order[0].generation

    def add(self, generation: Generation) -> None:
        entry = _Waiting(generation, next(self._arrivals))
        self._entries[generation] = entry
        self._insert(entry)

    def remove(self, generation: Generation) -> None:
        """Drop a generation that will not start (cancelled, its client gone, refused);
        ValueError when it is not waiting."""
        entry = self._entries.pop(generation, None)
        if entry is None:
            raise ValueError("not waiting")
        self._order.remove(entry)

    def take(self, generation: Generation) -> None:
        """`generation` starts now: out of the queue, and if it is interactive, each
        background request that arrived before it is passed once more."""
        entry = self._entries[generation]
        self.remove(generation)
        if entry.background:
            return
        for other in [waiting for waiting in self._order
                      if waiting.background and waiting.arrival < entry.arrival]:
            other.passed += 1
            if other.passed >= MAX_PASSES:
                self._order.remove(other)
                other.background = False
                self._insert(other)

    def _insert(self, entry: _Waiting) -> None:
        bisect.insort(self._order, entry, key=_Waiting.key)
