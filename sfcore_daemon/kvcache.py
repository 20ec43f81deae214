"""Which tokens each sequence's KV cells hold: prefix reuse, sharing, eviction.

The decode thread owns every `SeqCells`; `KVCache` keeps each one's `cached` list equal
to what llama.cpp's memory holds for that sequence, position by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .llama_c import C


class SeqCells:
    """One slot's sequence in the KV cache."""

    __slots__ = ("id", "cached", "prompt_rows")

    def __init__(self, seq_id: int) -> None:
        self.id = seq_id
        # Tokens whose rows are in the KV cache for this sequence, position by position.
        self.cached: list[int] = []
        # How many leading rows came from prompt evaluation (not single-token decode).
        self.prompt_rows = 0


def shared_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the common prefix of `a` and `b` (at most `limit`), compared a block
    at a time: list slices compare in C, so long prompts cost microseconds."""
    end = min(len(a), len(b))
    if limit is not None:
        end = min(end, max(limit, 0))
    start, block = 0, 256
    while start < end:
        stop = min(start + block, end)
        if a[start:stop] != b[start:stop]:
            while a[start] == b[start]:
                start += 1
            return start
        start = stop
    return end


class KVCache:
    """The cells of every sequence in one unified KV pool."""

    def __init__(self, memory: Any, seqs: Sequence[SeqCells], n_ubatch: int,
                 reproducible: bool) -> None:
        self._memory = memory
        self._seqs = seqs
        self._n_ubatch = n_ubatch
        self._reproducible = reproducible

    def reuse_prefix(self, seq: SeqCells, prompt: list[int]) -> int:
        """Give `seq` the longest usable cached prefix of `prompt`, from its own cache or,
        when another slot holds a longer one (a common system prompt), by sharing that
        slot's cells (llama_memory_seq_cp: a reference, not a copy). Returns its length."""
        memory = self._memory
        best, best_n = seq, self.usable(seq, prompt)
        for other in self._seqs:
            if other is not seq:
                n = self.usable(other, prompt)
                if n > best_n:
                    best, best_n = other, n
        if best_n == 0:
            return 0
        if best is not seq:
            self.forget(seq)
            C.llama_memory_seq_cp(memory, best.id, seq.id, 0, best_n)
            # As for the own slot below: every row of the prefix must still be there (a
            # sliding-window cache may have dropped the source's early rows once it ran
            # past the window); else the prompt is evaluated.
            if C.llama_memory_seq_pos_min(memory, seq.id) > 0:
                self.forget(seq)
                return 0
            seq.cached.extend(best.cached[:best_n])
            seq.prompt_rows = min(best.prompt_rows, best_n)
            return best_n
        removed = C.llama_memory_seq_rm(memory, seq.id, best_n, -1)
        if not removed or C.llama_memory_seq_pos_min(memory, seq.id) > 0:
            return 0
        del seq.cached[best_n:]
        seq.prompt_rows = min(seq.prompt_rows, best_n)
        return best_n

    def usable(self, seq: SeqCells, prompt: list[int]) -> int:
        """How much of `seq`'s cache `prompt` could reuse."""
        # The last prompt token must be evaluated, to produce logits.
        n = shared_prefix(seq.cached, prompt, len(prompt) - 1)
        if self._reproducible:
            # Only whole n_ubatch-aligned chunks of earlier prompt evaluation are
            # bit-identical to what a cold run computes.
            n = min(n, seq.prompt_rows)
            n -= n % self._n_ubatch
        return n

    def forget(self, seq: SeqCells) -> None:
        C.llama_memory_seq_rm(self._memory, seq.id, -1, -1)
        seq.cached.clear()
        seq.prompt_rows = 0

    def trim(self, seq: SeqCells) -> None:
        """Drop cells past `seq.cached` (whole ubatches an aborted decode left behind)."""
        C.llama_memory_seq_rm(self._memory, seq.id, len(seq.cached), -1)
