"""How `[model] n_ctx = 0` becomes a context size (sfcore_daemon/llama/ctxsize.py): pure
arithmetic, examples and a property."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.llama.ctxsize import CTX_STEP, MIB, ContextSize, choose

# Gemma 3 270M: 18 layers, one KV head of 256 + 256, F16.
GEMMA_TOKEN = 18 * 1 * 512 * 2


def test_a_set_n_ctx_is_kept() -> None:
    assert choose(4096, 32768, GEMMA_TOKEN, 1) == 4096


def test_the_trained_context_when_it_fits() -> None:
    assert choose(0, 32768, GEMMA_TOKEN, 4096 * MIB) == 32768
    assert choose(0, 8192, 30 * 3 * 128 * 2, 4096 * MIB) == 8192


def test_cut_to_the_budget_in_whole_steps() -> None:
    # 64 MiB hold 3640 tokens of Gemma's KV: 3584 in whole steps of 256.
    assert choose(0, 32768, GEMMA_TOKEN, 64 * MIB) == 3584
    # Never below one step, however small the budget.
    assert choose(0, 32768, GEMMA_TOKEN, 1) == CTX_STEP


def test_the_log_line_says_the_context_and_its_bytes() -> None:
    size = ContextSize(3584, 32768, GEMMA_TOKEN, 64 * MIB)
    assert size.kv_bytes == 3584 * GEMMA_TOKEN
    assert size.line() == ("context 3584 tokens (trained for 32768; KV 63 MiB at 18432 "
                           "bytes a token, budget 64 MiB)")


@given(trained=st.integers(1, 1 << 21), per_token=st.integers(1, 1 << 22),
       budget=st.integers(0, 1 << 40))
def test_the_chosen_context_fits_the_budget_or_is_one_step(trained: int, per_token: int,
                                                          budget: int) -> None:
    n_ctx = choose(0, trained, per_token, budget)
    assert n_ctx <= trained
    assert n_ctx * per_token <= budget or n_ctx == min(CTX_STEP, trained)
    assert n_ctx == trained or n_ctx % CTX_STEP == 0
