"""Which tokens each sequence's KV cells hold: prefix reuse, sharing, eviction.

The decode thread owns every `SeqCells`; `KVCache` keeps each one's `cached` list equal
to what llama.cpp's memory holds for that sequence, position by position.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.seqstate import window_pad

# llama_state_seq_*_ext: the window layers' part of a state alone.
_PARTIAL_ONLY = 1


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

    def __init__(self, memory: Any, seqs: Sequence[SeqCells], ctx: Any = None,
                 n_swa: int = 0, scratch: int | None = None) -> None:
        self._ctx = ctx
        # A sliding-window model's window: a prefix is usable when the rows its next token
        # attends to are there, as a restore keeps no others; 0: every row must be there.
        self._n_swa = n_swa
        # A sequence id no slot uses: a prefix of a slot's cells is copied there (a
        # reference, not a copy of rows) so that its state can be taken alone.
        self._scratch = scratch
        # The id whose cells hold a restored sequence's window rows in place (see
        # restore and seqstate.window_pad), after the scratch id and its per-slot ids.
        self._pad = None if scratch is None else scratch + 1 + len(seqs)
        self._padded_for = -1  # the slot whose restore the pad cells serve
        self._memory = memory
        self._seqs = seqs

    def best_reuse(self, seq: SeqCells, prompt: list[int]) -> int:
        """What `reuse_prefix` would give `seq`, without changing anything."""
        return max(self.usable(other, prompt) for other in self._seqs)

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
            # As for the own slot below: the rows the next token attends to must still be
            # there (a restored window holds only its last rows); else evaluate the prompt.
            if not self._rows_present(seq.id, best_n):
                self.forget(seq)
                return 0
            seq.cached.extend(best.cached[:best_n])
            seq.prompt_rows = min(best.prompt_rows, best_n)
            return best_n
        removed = C.llama_memory_seq_rm(memory, seq.id, best_n, -1)
        if not removed or not self._rows_present(seq.id, best_n):
            return 0
        del seq.cached[best_n:]
        seq.prompt_rows = min(seq.prompt_rows, best_n)
        return best_n

    def usable(self, seq: SeqCells, prompt: list[int]) -> int:
        """How much of `seq`'s cache `prompt` could reuse."""
        # The last prompt token must be evaluated, to produce logits.
        return shared_prefix(seq.cached, prompt, len(prompt) - 1)

    def forget(self, seq: SeqCells) -> None:
        self.unplace(seq)
        C.llama_memory_seq_rm(self._memory, seq.id, -1, -1)
        seq.cached.clear()
        seq.prompt_rows = 0

    def clear_if_empty(self) -> bool:
        """When no sequence holds cells, clear the whole pool: copies under spare ids and
        pad cells go too, and llama.cpp places the next cells from the first one on, as
        in a fresh context. Whether it did."""
        if any(seq.cached for seq in self._seqs):
            return False
        self._padded_for = -1
        C.llama_memory_clear(self._memory, False)
        return True

    def held(self, seq: SeqCells) -> int:
        """Positions `seq` holds in the pool, from 0 (an aborted decode keeps whole ubatches)."""
        return int(C.llama_memory_seq_pos_max(self._memory, seq.id)) + 1

    def trim(self, seq: SeqCells) -> None:
        """Drop cells past `seq.cached` (whole ubatches an aborted decode left behind)."""
        C.llama_memory_seq_rm(self._memory, seq.id, len(seq.cached), -1)

    def protect(self, seq: SeqCells, first: int) -> None:
        """Keep `seq`'s rows from position `first` up to its end from being reused while
        its later tokens are evaluated: llama.cpp's find_slot gives a sliding-window
        sequence's rows a window behind its last token to other tokens, but only rows
        of one sequence. So they are shared with `seq`'s own spare id (a reference,
        not a copy) until a state that needs them is taken, then released."""
        if self._scratch is not None and self._n_swa and first < len(seq.cached):
            C.llama_memory_seq_cp(self._memory, seq.id, self._scratch + 1 + seq.id,
                                  first, len(seq.cached))

    def release(self, seq: SeqCells) -> None:
        """Drop what `protect` kept for `seq`."""
        if self._scratch is not None and self._n_swa:
            C.llama_memory_seq_rm(self._memory, self._scratch + 1 + seq.id, -1, -1)

    def _place(self, seq: SeqCells, data: bytearray, n: int) -> None:
        """Fill the window cache's first cells with pad cells, so that the window rows
        of the state restored next land where a cold run puts them: a cold prompt read
        into an empty pool has its row at position p in cell p of both caches, and a
        restore alone would put the window rows at the window cache's first cells.
        Only with an empty pool: elsewhere there is no one cold layout to match."""
        if not self.can_place(seq):
            return
        C.llama_memory_seq_rm(self._memory, seq.id, -1, -1)
        pad = window_pad(data, n - min(n, self._n_swa))
        if pad is None:
            return
        blob, window_cells = pad
        if window_cells != min(n, self._n_swa):
            return  # a window this module does not know: no guess at its cells
        placed = C.llama_state_seq_set_data_ext(
            self._ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), blob.size,
            self._pad, _PARTIAL_ONLY)
        self._padded_for = seq.id
        if not placed:
            self.unplace(seq)

    def can_place(self, seq: SeqCells) -> bool:
        """Whether a restore into `seq` would be placed: a sliding-window model, a pad
        sequence id, and no other slot holding cells."""
        return (self._pad is not None and self._n_swa > 0
                and not any(other.cached for other in self._seqs if other is not seq))

    def unplace(self, seq: SeqCells) -> None:
        """Free the pad cells of `seq`'s placed restore, if any (at its job's end: until
        then they stand where a cold run has the sequence's own older window rows)."""
        if self._padded_for == seq.id:
            assert self._pad is not None
            C.llama_memory_seq_rm(self._memory, self._pad, -1, -1)
            self._padded_for = -1

    def _rows_present(self, seq_id: int, n: int) -> bool:
        """Whether sequence `seq_id` has the rows a token at position n attends to."""
        # The token at position n attends to positions above n - n_swa.
        first_needed = max(0, n - self._n_swa + 1) if self._n_swa else 0
        return bool(C.llama_memory_seq_pos_min(self._memory, seq_id) <= first_needed)

    def state(self, seq: SeqCells, n: int) -> bytearray | None:
        """The state of the first `n` of `seq`'s cells (llama_state_seq_get_data): its K
        and V rows, position by position, of which a sliding-window model keeps only
        the last window in its window layers. So it can continue at position n (or
        n - 1), not at an earlier one. None if llama.cpp gives none."""
        sid = seq.id
        if n < len(seq.cached):
            if self._scratch is None:
                return None
            sid = self._scratch
            C.llama_memory_seq_cp(self._memory, seq.id, sid, 0, n)
        try:
            # A sequence restored from a state lacks the window rows before its restore
            # point, and so would a state of an earlier prefix of it: none is taken.
            if not self._rows_present(sid, n):
                return None
            size = C.llama_state_seq_get_size(self._ctx, sid)
            if size <= 0:
                return None
            data = bytearray(size)
            view = (ctypes.c_uint8 * size).from_buffer(data)
            written = C.llama_state_seq_get_data(self._ctx, view, size, sid)
            del view  # the bytearray stays locked while a ctypes view of it exists
        finally:
            if sid != seq.id:
                C.llama_memory_seq_rm(self._memory, sid, -1, -1)
        return data if written == size else None

    def restore(self, seq: SeqCells, data: bytearray, tokens: list[int], n: int, *,
                place: bool = False) -> bool:
        """Put a stored state of `tokens` into `seq` and keep its first `n` rows (n is
        len(tokens) or one less); False (and `seq` empty) if llama.cpp refuses it or
        its rows do not line up. `place`: when no other sequence holds cells, its
        window rows go where a cold run of the same prompt puts them (see `_place`)."""
        if place:
            self._place(seq, data, len(tokens))
        view = (ctypes.c_uint8 * len(data)).from_buffer(data)
        try:
            loaded = C.llama_state_seq_set_data(self._ctx, view, len(data), seq.id)
        finally:
            del view
        memory, sid = self._memory, seq.id
        seq.cached.clear()
        seq.prompt_rows = 0
        if (not loaded or C.llama_memory_seq_pos_max(memory, sid) != len(tokens) - 1
                or not C.llama_memory_seq_rm(memory, sid, n, -1)
                or not self._rows_present(seq.id, n)):
            self.forget(seq)
            return False
        seq.cached.extend(tokens[:n])
        return True
