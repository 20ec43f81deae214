"""A sequence's attention does not depend on where other sequences' cells sit in the
daemon's one KV pool (scripts/llama-patches/fa-split-kv-balance.patch).

One query row over 512 or more cells takes ggml's split-KV flash attention: the cells
are cut into one part per thread and the parts' partial sums merged. Unpatched, the
parts are equal pieces of the whole pool, so idle slots' cells moved the cut inside a
sequence's own cells (another float sum) and could leave one thread all the work
(SmolLM2 decoded 7-8.5% slower per token beside idle slots' cells). Patched, the parts
are equal shares of the cells the row attends to: the same cut, the same bits.

Several sequences decoding together interleave their cells. Each query row lists its
mask row's shown cells once and reads the list for every head (rows run heads first):
a row's logits must not depend on what the other rows of its batch, or their cells, are.

Real model (SmolLM2-135M: plain full attention, 30 layers), the daemon's own context
settings, llama.cpp's C API in this process.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.logitrow import row_view
from sfcore_daemon.llama.model import Model
from tests.kit.models import smollm2_path

CONTEXT = 300  # the sequence's own cells: past 256, so alone it takes the split path too
IDLE = (200, 150)  # two idle sequences' cells, decoded after it


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    loaded = Model.load(str(smollm2_path()), ModelConfig(n_ctx=2048, flash_attn=True), 2, 2,
                        slots=1 + len(IDLE), draft_rows=3)
    try:
        yield loaded
    finally:
        assert loaded.close(10)


def _decode(model: Model, seq: int, tokens: list[int], start: int, logits: bool) -> None:
    batch = C.llama_batch_init(model.n_batch, 0, 1)
    try:
        for first in range(0, len(tokens), model.n_batch):
            chunk = tokens[first:first + model.n_batch]
            for row, token in enumerate(chunk):
                batch.token[row], batch.pos[row] = token, start + first + row
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
                batch.logits[row] = 0
            batch.logits[len(chunk) - 1] = int(logits)
            batch.n_tokens = len(chunk)
            assert C.llama_decode(model.ctx, batch) == 0
    finally:
        C.llama_batch_free(batch)


def _next_logits(model: Model, idle: tuple[int, ...]) -> bytes:
    """The logits row of one token decoded alone after CONTEXT tokens of sequence 0, with
    `idle` sequences' cells put into the pool between the two."""
    C.llama_memory_clear(model.memory, True)
    _decode(model, 0, [1000 + index % 700 for index in range(CONTEXT)], 0, logits=False)
    for seq, cells in enumerate(idle, start=1):
        _decode(model, seq, [2000 + (index * 7) % 900 for index in range(cells)], 0,
                logits=False)
    _decode(model, 0, [4242], CONTEXT, logits=True)
    row = C.llama_get_logits_ith(model.ctx, -1)
    return ctypes.string_at(row, model.info.n_vocab * ctypes.sizeof(ctypes.c_float))


def test_idle_cells_in_the_pool_do_not_change_a_sequence_s_logits(model: Model) -> None:
    alone = _next_logits(model, ())
    # Alone: 301 cells in a 512-cell window, cut at cell 256 unpatched. Beside the idle
    # cells: the new token lands after them (cell 650), a 768-cell window, cut at 384.
    beside = _next_logits(model, IDLE)
    assert beside == alone
    assert _next_logits(model, ()) == alone  # and the row is the model's, run to run


def _batched_logits(model: Model, others: tuple[int, int], base: int) -> bytes:
    """Sequence 0's logits row after 4 steps of 3 rows (sequences 0, 1, 2 together), the
    other two with `others` cells before and tokens from `base`."""
    C.llama_memory_clear(model.memory, True)
    _decode(model, 0, [1000 + index % 700 for index in range(CONTEXT)], 0, logits=False)
    for seq, cells in enumerate(others, start=1):
        _decode(model, seq, [base + (index * 7) % 900 for index in range(cells)], 0,
                logits=False)
    batch = C.llama_batch_init(3, 0, 1)
    try:
        for step in range(4):
            rows = [(0, 4242 + step, CONTEXT + step)] + [
                (seq, base + 11 * step + seq, cells + step)
                for seq, cells in enumerate(others, start=1)]
            for row, (seq, token, position) in enumerate(rows):
                batch.token[row], batch.pos[row] = token, position
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
                batch.logits[row] = int(row == 0 and step == 3)
            batch.n_tokens = len(rows)
            assert C.llama_decode(model.ctx, batch) == 0
    finally:
        C.llama_batch_free(batch)
    row = C.llama_get_logits_ith(model.ctx, 0)
    return ctypes.string_at(row, model.info.n_vocab * ctypes.sizeof(ctypes.c_float))


def test_a_row_s_logits_do_not_depend_on_the_other_rows_of_its_batch(model: Model) -> None:
    first = _batched_logits(model, IDLE, 2000)
    # Other sequences' lengths and tokens: other cells in the pool, interleaved with
    # sequence 0's new ones, other rows beside its row in every step.
    assert _batched_logits(model, (40, 310), 3000) == first
    assert _batched_logits(model, IDLE, 2000) == first


def _verified_logits(model: Model, others: tuple[int, int], base: int) -> list[bytes]:
    """Sequence 0's logits rows for 4 rows of its own (a draft's verification) beside one
    row of each of two other sequences with `others` cells and tokens from `base`."""
    C.llama_memory_clear(model.memory, True)
    _decode(model, 0, [1000 + index % 700 for index in range(CONTEXT)], 0, logits=False)
    for seq, cells in enumerate(others, start=1):
        _decode(model, seq, [base + (index * 7) % 900 for index in range(cells)], 0,
                logits=False)
    rows = [(0, 4242 + step, CONTEXT + step) for step in range(4)] + [
        (seq, base + seq, cells) for seq, cells in enumerate(others, start=1)]
    batch = C.llama_batch_init(len(rows), 0, 1)
    try:
        for row, (seq, token, position) in enumerate(rows):
            batch.token[row], batch.pos[row] = token, position
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
            batch.logits[row] = int(seq == 0)
        batch.n_tokens = len(rows)
        assert C.llama_decode(model.ctx, batch) == 0
    finally:
        C.llama_batch_free(batch)
    size = model.info.n_vocab * ctypes.sizeof(ctypes.c_float)
    return [ctypes.string_at(C.llama_get_logits_ith(model.ctx, row), size) for row in range(4)]


def test_a_verification_s_rows_do_not_depend_on_other_sequences_rows(model: Model) -> None:
    """Rows of one sequence whose masks show nearly the same cells are attended together
    (scripts/llama-patches/fa-units-ops.patch), a KV cell read once for all of them; rows
    of other sequences, whose cells are others, must not join them."""
    first = _verified_logits(model, IDLE, 2000)
    assert len(set(first)) == 4  # four positions, four rows
    assert _verified_logits(model, (40, 310), 3000) == first
    assert _verified_logits(model, IDLE, 2000) == first


def test_the_kept_row_view_reads_the_row_llama_cpp_gives(model: Model) -> None:
    """llama/logitrow.py: the numpy view kept per address is the row just written, by the
    row's own length (another vocabulary at the same address gets a view of its own)."""
    first = _next_logits(model, ())
    n_vocab = model.info.n_vocab
    view = row_view(model.ctx, -1, n_vocab)
    assert view.size == n_vocab and view.tobytes() == first
    assert row_view(model.ctx, -1, n_vocab // 2).size == n_vocab // 2
    second = _next_logits(model, IDLE[:1])  # another step writes the same buffer again
    assert row_view(model.ctx, -1, n_vocab) is view and view.tobytes() == second


# A tile's first row, the first past a cut at 33 rows, its last: no more outputs than a
# step of the daemon's may ask for.
KEPT = (0, 33, 63)


def _chunk_logits(model: Model, own: int, beside: int) -> dict[int, bytes]:
    """Sequence 0's logits rows (those of KEPT) for `own` prompt rows of its own after
    CONTEXT cells, read in one batch with `beside` rows of sequence 1 (a stream's, a short
    prompt's) after it."""
    C.llama_memory_clear(model.memory, True)
    _decode(model, 0, [1000 + index % 700 for index in range(CONTEXT)], 0, logits=False)
    _decode(model, 1, [2000 + (index * 7) % 900 for index in range(IDLE[0])], 0,
            logits=False)
    rows = [(0, 3000 + index, CONTEXT + index) for index in range(own)] + [
        (1, 2500 + index, IDLE[0] + index) for index in range(beside)]
    batch = C.llama_batch_init(len(rows), 0, 1)
    try:
        for row, (seq, token, position) in enumerate(rows):
            batch.token[row], batch.pos[row] = token, position
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, seq
            batch.logits[row] = int(seq == 0 and row in KEPT)
        batch.n_tokens = len(rows)
        assert C.llama_decode(model.ctx, batch) == 0
    finally:
        C.llama_batch_free(batch)
    size = model.info.n_vocab * ctypes.sizeof(ctypes.c_float)
    return {row: ctypes.string_at(C.llama_get_logits_ith(model.ctx, row), size)
            for row in KEPT}


def test_a_tiled_chunk_s_rows_do_not_depend_on_how_the_batch_is_cut(model: Model) -> None:
    """From 64 rows a batch takes flash attention's tiled path, in tiles of 64 rows of one
    head handed whole to the threads (scripts/llama-patches/fa-whole-tiles.patch). A
    prompt chunk's row is the same whether its tile is full or cut short, whatever else
    the batch holds: one decode row beside it, a few rows, or more of its own rows."""
    alone = _chunk_logits(model, 64, 0)
    assert len(set(alone.values())) == len(KEPT)
    assert _chunk_logits(model, 64, 1) == alone  # 65 rows: each head's 65th row a tile
    assert _chunk_logits(model, 64, 9) == alone
    assert _chunk_logits(model, 72, 0) == alone  # each head's second tile holds 8 rows
    assert _chunk_logits(model, 72, 1) == alone


def _chunk_after(model: Model, idle: tuple[int, ...]) -> bytes:
    """The last row's logits of a CONTEXT-token prompt read as one chunk (the tiled
    path) after `idle` sequences' cells were put into the pool."""
    C.llama_memory_clear(model.memory, True)
    for seq, cells in enumerate(idle, start=1):
        _decode(model, seq, [2000 + (index * 7) % 900 for index in range(cells)], 0,
                logits=False)
    _decode(model, 0, [1000 + index % 700 for index in range(CONTEXT)], 0, logits=True)
    row = C.llama_get_logits_ith(model.ctx, -1)
    return ctypes.string_at(row, model.info.n_vocab * ctypes.sizeof(ctypes.c_float))


def test_a_prompt_chunk_reads_the_same_beside_other_sequences_cells(model: Model) -> None:
    """A prompt chunk's tiles of cells hidden from all its rows (other sequences' cells,
    its own later positions) are passed over on the mask's bits alone
    (scripts/llama-patches/fa-tiled-hidden-tiles.patch): after whole tiles of idle cells
    the chunk reads what it reads with the pool to itself. (Idle cells that end inside a
    tile regroup the chunk's own cells into tiles: another float sum, patched or not.)"""
    alone = _chunk_after(model, ())
    assert _chunk_after(model, (256,)) == alone
    assert _chunk_after(model, (128, 64)) == alone
