"""A step's cost by its logit rows: which `[speculative] row_multiple` drafts are rounded
around (the tuner's last measurement, tune/sweep.py)."""

from __future__ import annotations

import math
import statistics

# Row multiples tried for [speculative] row_multiple, largest first: with a kernel taking
# rows m at a time, k*m + 1 rows cost about k*m + m (docs/performance/tune.md).
ROW_MULTIPLES = (8, 4, 2)
ROW_GROUPS = (1, 2, 3)  # k in k*m: the multiples compared
SAWTOOTH = 0.75  # least share of the next m rows' cost the row past k*m adds, for m
# Step sizes are measured this many times per --runs run (each a few tens of ms), in a
# shuffled order each round so that drift spreads over all of them.
ROW_ROUNDS_PER_RUN = 3


def row_sizes() -> tuple[int, ...]:
    """The step sizes (logit rows) choose_row_multiple compares."""
    return tuple(sorted({k * m + extra for m in ROW_MULTIPLES for k in ROW_GROUPS
                         for extra in (0, 1, m)}))


def leftover_shares(costs: dict[int, float]) -> dict[int, float]:
    """For each candidate multiple m: the median over k of what the first row past k*m
    adds to a step, as a share of what the next m rows together add."""
    shares: dict[int, float] = {}
    for m in ROW_MULTIPLES:
        ratios = []
        for k in ROW_GROUPS:
            first = costs[k * m + 1] - costs[k * m]
            whole = costs[(k + 1) * m] - costs[k * m]
            # A whole group no dearer than the one row: that row is all of the cost.
            ratios.append(first / whole if whole > 0 else (math.inf if first > 0 else 0.0))
        shares[m] = statistics.median(ratios)
    return shares


def choose_row_multiple(costs: dict[int, float]) -> int:
    """The largest multiple whose leftover rows cost about a whole group; 1 (no
    rounding) where rows cost what they cost one by one."""
    shares = leftover_shares(costs)
    return next((m for m in ROW_MULTIPLES if shares[m] >= SAWTOOTH), 1)
