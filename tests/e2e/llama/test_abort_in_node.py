"""A prompt's step stopped by llama.cpp's abort callback, wherever the callback says it,
stops whole and leaves the cache as it was before the step.

The daemon stops a long prompt's step for a newer short request (engine/steploop.py).
llama.cpp asks the callback after each node, and, for flash attention's tiled path,
also between its tiles (scripts/llama-patches/fa-whole-tiles.patch): a node stopped
there has unfinished output, so the graph must end after it even if the callback says
"go on" when asked next (scripts/llama-patches/cpu-abort-in-node.patch). Checked with a
callback that says stop at exactly one of its calls, for calls spread over a whole step
(asked before every tile: `GGML_CPU_ABORT_ASK_US=0`, where the daemon asks at most every
few milliseconds): the step reports the stop every time, and the same step read again
gives the logits of a step never stopped.

Real model (SmolLM2-135M), the daemon's own context settings, llama.cpp's C API in this
process.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model
from tests.kit.models import smollm2_path

CONTEXT = 400  # the prompt's cells before the step
ROWS = 128  # the step's prompt rows: the tiled path, two tiles a head
SAMPLES = 20  # calls of the callback at which a stop is said, spread over a step
DECODE_ABORTED = 2  # llama_decode's return value when the callback said stop


@pytest.fixture(scope="module")
def model() -> Iterator[Model]:
    loaded = Model.load(str(smollm2_path()), ModelConfig(n_ctx=2048, flash_attn=True), 2, 2,
                        slots=1, draft_rows=3)
    try:
        yield loaded
    finally:
        assert loaded.close(10)


def _decode(model: Model, first: int, count: int, logits: bool) -> int:
    batch = C.llama_batch_init(count, 0, 1)
    try:
        for row in range(count):
            batch.token[row], batch.pos[row] = 1000 + (first + row) % 700, first + row
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, 0
            batch.logits[row] = int(logits and row == count - 1)
        batch.n_tokens = count
        return int(C.llama_decode(model.ctx, batch))
    finally:
        C.llama_batch_free(batch)


def _step(model: Model, says_stop: Callable[[], bool] | None, rows: int = ROWS) -> int:
    """The step of `rows` prompt rows after CONTEXT cells, with `says_stop` as the abort
    callback (None: no callback); llama_decode's return value."""
    callback: Any = C.ggml_abort_callback()
    if says_stop is not None:
        asks = says_stop
        callback = C.ggml_abort_callback(lambda _data: asks())
    C.llama_set_abort_callback(model.ctx, callback, None)
    try:
        return _decode(model, CONTEXT, rows, logits=True)
    finally:
        C.llama_set_abort_callback(model.ctx, C.ggml_abort_callback(), None)


def _logits(model: Model) -> bytes:
    row = C.llama_get_logits_ith(model.ctx, -1)
    return ctypes.string_at(row, model.info.n_vocab * ctypes.sizeof(ctypes.c_float))


def _fresh_prompt(model: Model) -> None:
    C.llama_memory_clear(model.memory, True)
    assert _decode(model, 0, CONTEXT, logits=False) == 0


def _calls(model: Model, rows: int) -> int:
    """How often a whole step of `rows` prompt rows asks the callback."""
    calls = 0

    def counts() -> bool:
        nonlocal calls
        calls += 1
        return False

    _fresh_prompt(model)
    assert _step(model, counts, rows) == 0
    return calls


def test_a_stop_said_once_stops_the_step_and_leaves_the_cache_as_it_was(
        model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_CPU_ABORT_ASK_US", "0")  # read by each graph
    # 63 rows take the untiled path, with the same graph: the calls beyond its count are
    # asked inside flash attention's nodes, and some of the stops below fall there.
    between_nodes = _calls(model, 63)
    calls = _calls(model, ROWS)
    whole = _logits(model)
    assert calls > between_nodes + SAMPLES
    # Thread 0's share of the tiles, and so the count, moves from step to step; every step
    # asks at least once a node.
    for stop_at in range(1, between_nodes + 1, between_nodes // SAMPLES):
        said = 0

        def once(stop_at: int = stop_at) -> bool:
            nonlocal said
            said += 1
            return said == stop_at

        _fresh_prompt(model)
        assert _step(model, once) == DECODE_ABORTED, f"a stop at call {stop_at}"
        assert C.llama_memory_seq_pos_max(model.memory, 0) == CONTEXT - 1
        assert _step(model, None) == 0
        assert _logits(model) == whole, f"after a stop at call {stop_at}"
