"""Prompt rows a step takes beside streams and of short rests by the measured step
costs (engine/prefillshare.py), and what a row adds by the context it attends to
(draftgate.attended_ns): pure arithmetic on given costs, no model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.engine.draftgate import StepCosts, attended_ns
from sfcore_daemon.engine.prefillshare import PrefillShare
from sfcore_daemon.llama.stepcost import (
    DEPTH,
    DEPTH_KEY,
    FAR_DEPTH_KEY,
    FAR_PROMPT_CELL_KEY,
    PROMPT_CELL_KEY,
    PROMPT_ROW_KEY,
)

MS = 1e6


def share(prompt_row_ms: float, **keys: float) -> PrefillShare:
    measured = {1: 10 * MS, 2: 14 * MS, 4: 22 * MS, PROMPT_ROW_KEY: prompt_row_ms * MS}
    names = {"cell": PROMPT_CELL_KEY, "far_cell": FAR_PROMPT_CELL_KEY,
             "logit_cell": DEPTH_KEY, "far_logit_cell": FAR_DEPTH_KEY}
    measured.update({names[name]: ns for name, ns in keys.items()})
    return PrefillShare(measured, 8)


def test_a_step_takes_the_prompt_rows_that_cost_what_its_streams_cost() -> None:
    assert share(1.0).rows(1, 0, 0) == 10
    assert share(2.0).rows(1, 0, 0) == 5  # a dearer model or machine: fewer rows
    assert share(1.0).rows(4, 0, 0) == 22  # more streams: more rows
    assert share(30.0).rows(1, 0, 0) == 1  # never none: a prompt beside streams moves on


def test_a_deeper_prompt_gets_fewer_rows_and_a_deeper_stream_more() -> None:
    deep = share(1.0, cell=1000.0)  # a prompt row adds 1 ms per 1000 cells it attends to
    assert deep.rows(1, 0, 0) == 10
    assert deep.rows(1, 0, 1000) == 5
    assert deep.rows(1, 0, DEPTH) < deep.rows(1, 0, 1000) or DEPTH <= 1000
    streams = share(1.0, logit_cell=1000.0)
    assert streams.rows(1, 10_000, 0) > streams.rows(1, 0, 0)


def test_past_the_measured_depth_a_row_costs_the_far_rate() -> None:
    # A sliding-window model: past DEPTH only the global layers' rows cost more by the cell.
    windowed = share(1.0, cell=1000.0, far_cell=100.0)
    plain = share(1.0, cell=1000.0)
    assert windowed.rows(1, 0, 8 * DEPTH) > plain.rows(1, 0, 8 * DEPTH)
    assert windowed.rows(1, 0, DEPTH) == plain.rows(1, 0, DEPTH)


def test_costs_without_a_prompt_row_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt row"):
        PrefillShare({1: 10 * MS, 2: 14 * MS}, 8)


def test_attention_is_continuous_at_the_measured_depth() -> None:
    assert attended_ns(DEPTH, 3.0, 1.0) == DEPTH * 3.0
    assert attended_ns(DEPTH + 10, 3.0, 1.0) == DEPTH * 3.0 + 10
    assert attended_ns(0, 3.0, 1.0) == 0.0
    costs = StepCosts({1: 10 * MS, 2: 14 * MS, DEPTH_KEY: 1000.0, FAR_DEPTH_KEY: 10.0}, 8)
    assert costs.cost_at(2, 3 * DEPTH) == pytest.approx(
        14 * MS + 2 * (DEPTH * 1000.0 + 2 * DEPTH * 10.0))


@given(one=st.floats(1e4, 1e9), prompt_row=st.floats(1e3, 1e9), cell=st.floats(0, 1e5),
       far=st.floats(0, 1e5), streams=st.integers(1, 8), stream_depth=st.integers(0, 1 << 17),
       prompt_depth=st.integers(0, 1 << 17))
def test_the_prompt_rows_cost_at_most_the_streams_step_unless_one(
        *, one: float, prompt_row: float, cell: float, far: float, streams: int,
        stream_depth: int, prompt_depth: int) -> None:
    measured = {1: one, 8: 4 * one, PROMPT_ROW_KEY: prompt_row, PROMPT_CELL_KEY: cell,
                FAR_PROMPT_CELL_KEY: far}
    rows = PrefillShare(measured, 8).rows(streams, stream_depth, prompt_depth)
    streams_ns = StepCosts(measured, 8).cost_at(streams, stream_depth)
    row_ns = prompt_row + attended_ns(prompt_depth, cell, far)
    assert rows >= 1
    assert rows == 1 or rows * row_ns <= streams_ns * (1 + 1e-9)
    assert (rows + 1) * row_ns > streams_ns * (1 - 1e-9)


def test_short_rests_take_more_rows_a_step_where_a_step_s_fixed_part_costs_more() -> None:
    # a = 10 ms (a one-row step), b = 1 ms a row: eight 32-token rests, sqrt(10 * 256).
    assert share(1.0).short_rows(0, 0, 0, 256) == 50
    # A dearer row (a wider model on the same machine): fewer rows a step.
    assert share(4.0).short_rows(0, 0, 0, 256) == 25
    # Streams in the step make its fixed part dearer: more rows a step.
    assert share(1.0).short_rows(4, 0, 0, 256) > share(1.0).short_rows(0, 0, 0, 256)
    # Rests after a long restored prefix attend over it: fewer rows a step.
    deep = share(1.0, cell=1000.0)
    assert deep.short_rows(0, 0, 4000, 256) < deep.short_rows(0, 0, 0, 256)
    assert share(1.0).short_rows(0, 0, 0, 0) == 1


def mean_wait(fixed: float, row: float, waiting: int, rows: int) -> float:
    """Short rests' mean wait when `waiting` rows of them are read `rows` a step, a step
    costing `fixed` plus `row` a row: step j ends at j (fixed + row * rows)."""
    steps = math.ceil(waiting / rows)
    ends = [(index + 1) * (fixed + row * rows) for index in range(steps)]
    # Each rest ends with the step that reads its last row; rows spread evenly.
    read = [min(rows, waiting - index * rows) for index in range(steps)]
    return sum(end * count for end, count in zip(ends, read, strict=True)) / waiting


@given(one=st.floats(1e5, 1e8), prompt_row=st.floats(1e4, 1e8), waiting=st.integers(1, 512))
def test_the_short_rows_are_within_a_row_of_the_least_mean_wait(
        *, one: float, prompt_row: float, waiting: int) -> None:
    measured = {1: one, 8: 4 * one, PROMPT_ROW_KEY: prompt_row}
    rows = PrefillShare(measured, 8).short_rows(0, 0, 0, waiting)
    assert rows >= 1
    fixed = StepCosts(measured, 8).cost_at(1, 0)
    chosen = mean_wait(fixed, prompt_row, waiting, min(rows, waiting))
    best = min(mean_wait(fixed, prompt_row, waiting, size) for size in range(1, waiting + 1))
    # The continuous optimum; whole steps move the mean by at most one step's rows.
    assert chosen <= best + fixed + prompt_row * (rows + 1)
