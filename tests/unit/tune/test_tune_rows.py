"""How `sfcore-daemon tune` picks [speculative] row_multiple from step costs (pure logic;
tests/lifecycle/test_tune.py runs the real sweep)."""

from __future__ import annotations

import math

import pytest

from sfcore_daemon.tune.rows import choose_row_multiple, leftover_shares, row_sizes

# Measured on the 2-vCPU x86 machine with the default model (docs/performance.md, "Rows
# come in fours"): llamafile's tinyBLAS takes the Q8_0 output matrix's logit rows four at
# a time and sweeps the matrix again for the 1-3 left over.
TINYBLAS_MS = {1: 19.6, 2: 27.5, 3: 31.0, 4: 34.5, 5: 50.6, 6: 56.6, 7: 61.1, 8: 53.3,
               9: 69.9, 12: 72.1, 13: 89.6, 16: 88.8, 17: 108.5, 24: 130.1, 25: 146.7,
               32: 169.0}


def grouped(group: int, fixed: float = 15.0, per_row: float = 4.7) -> dict[int, float]:
    """A kernel that pays for rows `group` at a time."""
    return {size: fixed + per_row * group * math.ceil(size / group) for size in row_sizes()}


def test_the_measured_tinyblas_costs_give_four() -> None:
    assert choose_row_multiple(TINYBLAS_MS) == 4
    shares = leftover_shares(TINYBLAS_MS)
    assert shares[4] > 0.8 and shares[8] < 0.5


@pytest.mark.parametrize("group", [2, 4, 8])
def test_a_kernel_that_pays_for_whole_groups_gets_its_group(group: int) -> None:
    assert choose_row_multiple(grouped(group)) == group


def test_rows_that_cost_the_same_each_are_not_rounded() -> None:
    # A large fixed cost must not pass for a sawtooth: only the rows' own costs count.
    for fixed in (1.0, 15.0, 200.0):
        assert choose_row_multiple(grouped(1, fixed)) == 1


def test_a_dearer_partial_group_counts_as_all_of_the_cost() -> None:
    # One row past 4 costing more than 8 rows (seen: 7 rows 61.1 ms, 8 rows 53.3).
    costs = grouped(4)
    costs[5] = costs[8] + 5.0
    assert leftover_shares(costs)[4] >= 1.0
    assert choose_row_multiple(costs) == 4


def test_the_sizes_measured_cover_every_comparison() -> None:
    sizes = set(row_sizes())
    assert {4, 5, 8, 9, 12, 13, 16, 17, 24, 25, 32} <= sizes
    assert choose_row_multiple({size: 10.0 + size for size in sizes}) == 1
