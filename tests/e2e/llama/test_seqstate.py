"""seqstate.py: the parts of a llama.cpp sequence state and the window pad built from
them. Synthetic states for the format's edges; one real state of the real model (a
sliding-window model: Gemma 3) to show the reading matches what llama.cpp writes, and
that llama.cpp takes the pad back.

This file holds the tests of llama.cpp and the real model in-process; those that need no
daemon and no model in tests/unit/llama/test_seqstate.py.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama import modelfile
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model
from sfcore_daemon.llama.sampling import import_numpy_beside
from sfcore_daemon.llama.seqstate import parts, window_pad


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    importing = import_numpy_beside()
    loaded = Model.load(modelfile.resolve_model_path(""), ModelConfig(n_ctx=2048), 2, 2,
                        slots=1, spare_seqs=1)
    importing.join(60)
    try:
        yield loaded
    finally:
        assert loaded.close(10)


def test_a_real_state_parses_and_the_pad_is_taken_back(model: Model) -> None:
    n_swa = C.llama_model_n_swa(model.model)
    assert n_swa > 0  # Gemma 3: a sliding window
    n = n_swa + 88
    batch = C.llama_batch_init(model.n_batch, 0, 1)
    try:
        for start in range(0, n, model.n_batch):
            rows = range(start, min(n, start + model.n_batch))
            for row, pos in enumerate(rows):
                batch.token[row], batch.pos[row], batch.logits[row] = 1000 + pos % 300, pos, 0
                batch.n_seq_id[row], batch.seq_id[row][0] = 1, 0
            batch.n_tokens = len(rows)
            assert C.llama_decode(model.ctx, batch) == 0
    finally:
        C.llama_batch_free(batch)
    size = C.llama_state_seq_get_size(model.ctx, 0)
    state = bytearray(size)
    view = (ctypes.c_uint8 * size).from_buffer(state)
    assert C.llama_state_seq_get_data(model.ctx, view, size, 0) == size
    del view
    found = parts(state)
    assert found is not None and len(found) == 2
    # Every row in the full-attention layers, only the last window in the others.
    assert [p.cells for p in found] == [n, n_swa]
    pad = window_pad(state, n - n_swa)
    assert pad is not None
    blob, window_cells = pad
    assert window_cells == n_swa
    taken = C.llama_state_seq_set_data_ext(
        model.ctx, blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), blob.size, 1, 1)
    assert taken == blob.size
    # The pad's cells are there, all at position 0, in the window layers alone.
    assert C.llama_memory_seq_pos_max(model.memory, 1) == 0
    C.llama_memory_clear(model.memory, True)
