"""The attention choice (llama/attnprobe.py): the depths measured, the range chosen from
their timings, the kept file, which the daemon reads from disk, and the timing itself
with the installed ggml."""

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
    assert attnprobe.depths(GEMMA, 32768)[-1] == 32768
    # 4 heads x 4 bytes a score: a quarter of 512 rows fits to 65,536 cells.
    assert attnprobe.most_cells(GEMMA, 1 << 20) == attnprobe.SCORES_BUDGET // (4 * 128 * 4)
    assert attnprobe.depths(GEMMA, 1 << 20)[-1] == attnprobe.most_cells(GEMMA, 1 << 20)
    assert attnprobe.depths(GEMMA, 512) == []


@given(st.integers(1, 1 << 22), st.integers(1, 64), st.sampled_from([32, 64, 500, 512, 2048]))
def test_a_step_is_cut_into_chunks_whose_scores_fit_the_budget(
        cells: int, n_head: int, rows: int) -> None:
    shape = Shape(n_head=n_head, n_head_kv=1, head_k=64, head_v=64, rows=rows)
    chunk = attnprobe.chunk_rows(shape, cells)
    # A chunk for exactly the depths the product may take.
    assert (chunk > 0) == (cells <= attnprobe.most_cells(shape, cells))
    if chunk:
        assert chunk <= rows
        assert 4 * cells * n_head * chunk <= attnprobe.SCORES_BUDGET
        assert chunk == rows or (chunk % attnprobe.CHUNK_ROWS == 0
                                 and -(-rows // chunk) <= attnprobe.MAX_CHUNKS)


def test_the_default_model_s_steps_are_cut_only_past_16384_cells() -> None:
    assert attnprobe.chunk_rows(GEMMA, 16384) == 512
    assert attnprobe.chunk_rows(GEMMA, 16385) == 480
    assert attnprobe.chunk_rows(GEMMA, 32768) == 256
    assert attnprobe.chunk_rows(GEMMA, 65536) == 128
    assert attnprobe.chunk_rows(GEMMA, 65537) == 0


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
    # A range past the context is not the daemon's own.
    assert attnprobe.parse(attnprobe.encode(GEMMA, 16384, Range(512, 0, 32768)),
                           GEMMA, 16384) is None


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
    assert os.environ[attnprobe.ENV] == f"512,2048,16384,{attnprobe.SCORES_BUDGET}"
    attnprobe.apply(None)
    assert attnprobe.ENV not in os.environ


def test_both_forms_are_timed_with_the_installed_ggml_at_each_depth() -> None:
    small = Shape(n_head=2, n_head_kv=1, head_k=64, head_v=64, rows=32)
    timings = attnprobe.measure(small, 2048, 1)
    assert [cells for cells, _, _ in timings] == [1024, 2048]
    for _, flash_ns, product_ns in timings:
        assert 0 < flash_ns < float("inf") and 0 < product_ns < float("inf")


def test_deeper_depths_are_not_timed_after_two_clear_losses_in_a_row() -> None:
    clear_loss = 1 + attnprobe.CLEAR + 0.05
    assert attnprobe.lost([(1024, 1.0, clear_loss), (2048, 1.0, clear_loss)])
    assert not attnprobe.lost([(1024, 1.0, clear_loss)])
    assert not attnprobe.lost([(1024, 1.0, clear_loss), (2048, 1.0, 1.05)])
    assert not attnprobe.lost([(1024, 1.0, 0.9), (2048, 1.0, clear_loss)])


def test_a_depth_is_settled_early_only_by_clear_gaps_on_one_side() -> None:
    clear_win, clear_loss, close = 0.7, 1.3, 0.95
    assert attnprobe.settled([100], [int(100 * clear_win)])
    assert attnprobe.settled([100, 100], [int(100 * clear_loss)] * 2)
    assert not attnprobe.settled([100], [int(100 * close)])
    assert not attnprobe.settled([100, 100], [int(100 * clear_win), int(100 * clear_loss)])


def test_timing_a_depth_again_takes_no_more_memory() -> None:
    # The product's work buffer alone (its scores as f16) is 32 MiB at this depth.
    shape = Shape(n_head=4, n_head_kv=1, head_k=64, head_v=64, rows=512)
    ggml = attnprobe._Ggml.load()
    assert ggml is not None
    ggml.time_both(shape, 8192, 1)
    before = _resident_mib()
    for _ in range(3):
        ggml.time_both(shape, 8192, 1)
    assert _resident_mib() - before < 16


def _resident_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS in /proc/self/status")
