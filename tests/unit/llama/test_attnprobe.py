"""The attention choice's pure parts (llama/attnprobe.py): the depths measured, the range
chosen from their timings, and the kept file, which the daemon reads from disk."""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.llama import attnprobe
from sfcore_daemon.llama.attnprobe import MARGIN, Range, Shape

GEMMA = Shape(n_head=4, n_head_kv=1, head_k=256, head_v=256, rows=512)


def test_depths_double_up_to_the_context_and_the_scores_budget() -> None:
    assert attnprobe.depths(GEMMA, 4096) == [1024, 2048, 4096]
    assert attnprobe.depths(GEMMA, 5000) == [1024, 2048, 4096, 5000]
    # 4 heads x 512 rows x 4 bytes a score: the budget stops at 16,384 cells.
    assert attnprobe.most_cells(GEMMA, 32768) == attnprobe.SCORES_BUDGET // (4 * 512 * 4)
    assert attnprobe.depths(GEMMA, 32768)[-1] == attnprobe.most_cells(GEMMA, 32768)
    assert attnprobe.depths(GEMMA, 512) == []


def test_the_longest_run_where_products_win_by_the_margin_is_chosen() -> None:
    won, lost, even = 0.9, 1.1, 1 - MARGIN / 2
    timings = [(1024, 1.0, lost), (2048, 1.0, won), (4096, 1.0, even), (8192, 1.0, won),
               (16384, 1.0, won)]
    assert attnprobe.choose(512, timings) == Range(512, 8192, 16384)
    assert attnprobe.choose(512, [(1024, 1.0, won), (2048, 1.0, lost)]) == Range(512, 1024, 1024)
    assert attnprobe.choose(512, [(1024, 1.0, even), (2048, 1.0, lost)]) is None
    assert attnprobe.choose(512, []) is None


@given(st.lists(st.tuples(st.floats(1, 1e9), st.floats(1, 1e9)), max_size=8))
def test_a_chosen_range_holds_only_depths_where_products_won(
        pairs: list[tuple[float, float]]) -> None:
    timings = [(1024 << index, flash, product) for index, (flash, product) in enumerate(pairs)]
    found = attnprobe.choose(512, timings)
    won = [cells for cells, flash, product in timings if product < flash * (1 - MARGIN)]
    if found is None:
        assert won == []
    else:
        inside = [cells for cells, _, _ in timings if found.first <= cells <= found.last]
        assert inside and set(inside) <= set(won)


def test_a_kept_choice_reads_back_only_for_its_shape_and_context() -> None:
    found = Range(512, 2048, 16384)
    data = attnprobe.encode(GEMMA, 32768, found)
    kept = attnprobe.parse(data, GEMMA, 32768)
    assert kept is not None and kept.range == found
    assert attnprobe.parse(attnprobe.encode(GEMMA, 32768, None), GEMMA, 32768) is not None
    assert attnprobe.parse(data, GEMMA, 16384) is None
    other = Shape(n_head=9, n_head_kv=3, head_k=64, head_v=64, rows=512)
    assert attnprobe.parse(data, other, 32768) is None
    # A range past what the scores budget allows is not the daemon's own.
    assert attnprobe.parse(attnprobe.encode(GEMMA, 32768, Range(512, 0, 32768)),
                           GEMMA, 32768) is None


@given(st.binary(max_size=600))
def test_any_bytes_read_as_a_kept_choice_or_as_none(data: bytes) -> None:
    kept = attnprobe.parse(data, GEMMA, 32768)
    assert kept is None or kept.shape == GEMMA


@given(st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.sampled_from(["version", "shape", "cells", "range",
                                                       "rows", "first", "last", "n_head"]),
                                      inner, max_size=5),
                    max_leaves=12))
def test_any_json_reads_as_a_kept_choice_or_as_none(value: object) -> None:
    kept = attnprobe.parse(msgspec.json.encode(value), GEMMA, 32768)
    assert kept is None or (kept.shape == GEMMA and kept.cells == 32768)


def test_the_range_goes_to_llama_cpp_through_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(attnprobe.ENV, raising=False)
    attnprobe.apply(Range(512, 2048, 16384))
    assert os.environ[attnprobe.ENV] == "512,2048,16384"
    attnprobe.apply(None)
    assert attnprobe.ENV not in os.environ
