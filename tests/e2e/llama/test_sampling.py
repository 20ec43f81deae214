"""A plain greedy request's token comes from numpy's argmax of its logits row instead of
llama.cpp's sampler chain (sampling.py): the same token on every row of a real decode of
the real model.

This file holds the tests of llama.cpp and the real model in-process; those that need no
daemon and no model in tests/unit/llama/test_sampling.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama import modelfile
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model
from sfcore_daemon.llama.sampling import (
    Sampling,
    argmax,
    import_numpy_beside,
    is_plain_greedy,
    make_chain,
)

# A plain greedy request's sampling (as in tests/unit/llama/test_sampling.py).
GREEDY = Sampling(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                  seed=None)

TEXT = ("def mean(values):\n    return sum(values) / len(values)\n\n"
        "Die Katze schläft auf dem warmen Fensterbrett. 東京は日本の首都です。 "
        "The quick brown fox jumps over the lazy dog, again and again and again")


@pytest.fixture(scope="module")
def decoded() -> Iterator[tuple[Model, int]]:
    """The model after one decode of TEXT with logits on every row; the row count."""
    importing = import_numpy_beside()
    model = Model.load(modelfile.resolve_model_path(""), ModelConfig(n_ctx=512), 2, 2, slots=1,
                       draft_rows=128)
    importing.join(60)
    tokens = model.tokenize(TEXT)[:128]
    batch = C.llama_batch_init(len(tokens), 0, 1)
    try:
        for row, token in enumerate(tokens):
            batch.token[row], batch.pos[row], batch.logits[row] = token, row, 1
            batch.n_seq_id[row], batch.seq_id[row][0] = 1, 0
        batch.n_tokens = len(tokens)
        assert C.llama_decode(model.ctx, batch) == 0
        yield model, len(tokens)
    finally:
        C.llama_batch_free(batch)
        assert model.close(10)


def test_argmax_draws_what_the_greedy_chain_draws_on_every_row(
        decoded: tuple[Model, int]) -> None:
    model, rows = decoded
    assert is_plain_greedy(GREEDY)
    chain, penalties = make_chain(model.vocab, GREEDY, [])
    assert penalties is None
    try:
        for row in range(rows):
            assert argmax(model.ctx, row, model.info.n_vocab) == \
                C.llama_sampler_sample(chain, model.ctx, row), row
    finally:
        C.llama_sampler_free(chain)


def test_the_chain_hands_over_its_repeat_penalty(decoded: tuple[Model, int]) -> None:
    """A grammar's masked draw rebuilds the penalty's history: it gets that sampler from
    make_chain, not by looking for it in the chain."""
    model, _ = decoded
    for sampling in (dataclasses.replace(GREEDY, repeat_penalty=1.1),
                     dataclasses.replace(GREEDY, temperature=0.7, repeat_penalty=1.1)):
        chain, penalties = make_chain(model.vocab, sampling, [1, 2, 3])
        try:
            assert penalties is not None
            assert C.llama_sampler_name(penalties) == b"penalties"
        finally:
            C.llama_sampler_free(chain)
