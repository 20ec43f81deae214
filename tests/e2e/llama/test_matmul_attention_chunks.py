"""A step's attention as matrix products in chunks of query rows
(scripts/llama-patches/matmul-attention.patch): the chunks read what one product over all
the step's rows reads, and both give flash attention's next token.

The daemon names the steps through SFCORE_MATMUL_ATTN="rows,from,to,budget", and the
patch cuts a step into chunks of whole 32-row groups whose scores fit the budget, so
that the compute buffer stays bounded at any depth. The daemon's own budget cuts only
steps past 16,384 cells on the default model, too long a prompt for the suite, so here a
small budget cuts steps of a short one.

Real default model, the daemon's own context settings, llama.cpp's C API in this process;
one context for each setting (the variable is read when a step's graph is built).
"""

from __future__ import annotations

import ctypes
import math
import os

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama import attnprobe
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model
from sfcore_daemon.llama.modelfile import default_model_path

PROMPT = 1030  # two full steps of 512 rows and a rest
# 4 heads x 4 bytes a score: a budget of 2 MiB cuts a step of 512 rows over 512 cells in
# two chunks, and over 1,024 cells in four.
SMALL_BUDGET = 2 << 20


def _text() -> str:
    """Plain prose, new in every sentence, so that the next token is a real guess."""
    subjects = ["The river", "A small boat", "The old mill", "Our neighbour", "The storm",
                "A letter", "The market", "Her brother", "The bridge", "A quiet dog"]
    verbs = ["crossed", "waited near", "remembered", "painted", "followed", "carried",
             "watched", "described", "repaired", "forgot"]
    objects = ["the valley at dawn", "a basket of apples", "the long road north",
               "the harbour lights", "an unfinished song", "the winter garden",
               "a map of the coast", "the broken clock", "the children's school",
               "a field of barley"]
    sentences = [f"{subjects[i % 10]} {verbs[(i * 3) % 10]} {objects[(i * 7) % 10]}."
                 for i in range(400)]
    return " ".join(sentences)


def _last_logits(env: str | None) -> list[float]:
    previous = os.environ.pop(attnprobe.ENV, None)
    if env is not None:
        os.environ[attnprobe.ENV] = env
    model = Model.load(str(default_model_path()), ModelConfig(n_ctx=2048, flash_attn=True),
                       2, 2, slots=1)
    try:
        tokens = model.tokenize(_text())[:PROMPT]
        assert len(tokens) == PROMPT
        batch = C.llama_batch_init(model.n_batch, 0, 1)
        try:
            for first in range(0, PROMPT, model.n_ubatch):
                chunk = tokens[first:first + model.n_ubatch]
                for row, token in enumerate(chunk):
                    batch.token[row], batch.pos[row] = token, first + row
                    batch.n_seq_id[row], batch.seq_id[row][0] = 1, 0
                    batch.logits[row] = int(first + row == PROMPT - 1)
                batch.n_tokens = len(chunk)
                assert C.llama_decode(model.ctx, batch) == 0
        finally:
            C.llama_batch_free(batch)
        row = C.llama_get_logits_ith(model.ctx, -1)
        return list((ctypes.c_float * model.info.n_vocab).from_address(
            ctypes.addressof(row.contents)))
    finally:
        assert model.close(10)
        os.environ.pop(attnprobe.ENV, None)
        if previous is not None:
            os.environ[attnprobe.ENV] = previous


def _top(logits: list[float]) -> int:
    return max(range(len(logits)), key=logits.__getitem__)


def test_chunks_of_rows_read_what_one_product_of_all_rows_reads() -> None:
    whole = _last_logits("512,0,1000000,0")
    chunked = _last_logits(f"512,0,1000000,{SMALL_BUDGET}")
    flash = _last_logits(None)
    # Each row's sums do not depend on the chunk it is in.
    assert max(abs(a - b) for a, b in zip(chunked, whole, strict=True)) < 1e-3
    # The products did run (their sums are not flash attention's) and read the same
    # prompt: the same next token, as likely.
    assert chunked != flash
    top = _top(flash)
    assert _top(chunked) == top
    assert abs(_logprob(chunked, top) - _logprob(flash, top)) < 0.05


def _logprob(logits: list[float], token: int) -> float:
    most = max(logits)
    return logits[token] - most - math.log(sum(math.exp(value - most) for value in logits))
