"""The step costs' drift check (engine/costdrift.py), pure logic: live steps' times
against the costs' estimates, wide steps relative to one-row ones. The daemon's own
check is tested live in tests/e2e/ndjson/test_draftgate.py."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.engine.costdrift import DRIFT, LEAST_STEPS, CostDrift

ONE_ROW_NS = 10_000_000


def estimate(rows: int) -> float:
    return ONE_ROW_NS * (1 + 0.3 * (rows - 1))


def feed(drift: CostDrift, steps: int, *, load: float = 1.0, wide_skew: float = 1.0,
         noise: float = 0.0, seed: int = 0) -> None:
    """`steps` steps of each kind, alternated: each takes its estimate times `load`
    (the machine), times `wide_skew` for wide ones (the costs gone wrong), times up to
    1 + `noise` (a step the scheduler delayed)."""
    draw = random.Random(seed)
    for _ in range(steps):
        for rows in (1, draw.randint(2, 17)):
            late = 1 + noise * draw.random()
            elapsed = estimate(rows) * load * late * (wide_skew if rows > 1 else 1.0)
            drift.observe(rows, int(elapsed), estimate(rows))


def test_nothing_is_said_before_enough_steps_of_each_kind() -> None:
    drift = CostDrift()
    feed(drift, LEAST_STEPS - 1, wide_skew=3.0)
    assert drift.ratio() is None and not drift.drifted()
    for _ in range(500):  # one-row steps alone say nothing of the curve
        drift.observe(1, ONE_ROW_NS, estimate(1))
    assert drift.ratio() is None
    feed(drift, 1, wide_skew=3.0)
    assert drift.ratio() is not None and drift.drifted()


def test_costs_that_fit_do_not_drift_and_a_wrong_curve_does() -> None:
    fits = CostDrift()
    feed(fits, 300)
    assert abs((fits.ratio() or 0) - 1.0) < 1e-9 and not fits.drifted()
    dearer, cheaper = CostDrift(), CostDrift()
    feed(dearer, LEAST_STEPS, wide_skew=1.6)
    feed(cheaper, LEAST_STEPS, wide_skew=0.6)
    assert dearer.drifted() and abs((dearer.ratio() or 0) - 1.6) < 1e-9
    assert cheaper.drifted() and abs((cheaper.ratio() or 0) - 0.6) < 1e-9


def test_a_drift_that_comes_later_is_seen_and_one_that_goes_clears() -> None:
    drift = CostDrift()
    feed(drift, 400)
    assert not drift.drifted()
    feed(drift, 200, wide_skew=1.5, seed=1)
    assert drift.drifted()
    feed(drift, 400, seed=2)
    assert not drift.drifted()


def test_bad_figures_are_ignored() -> None:
    drift = CostDrift()
    for rows, elapsed, expected in ((0, 5, 5.0), (1, 0, 5.0), (2, -3, 5.0), (3, 5, 0.0)):
        drift.observe(rows, elapsed, expected)
    assert drift.narrow_steps == drift.wide_steps == 0


@settings(max_examples=60, deadline=None)
@given(load=st.floats(0.3, 4.0), noise=st.floats(0.0, 0.2), seed=st.integers(0, 2**16),
       steps=st.integers(LEAST_STEPS, 400))
def test_a_busy_machine_alone_never_reads_as_drift(load: float, noise: float, seed: int,
                                                   steps: int) -> None:
    # Load slows every step alike (and delays some at random): the curve still fits.
    drift = CostDrift()
    feed(drift, steps, load=load, noise=noise, seed=seed)
    ratio = drift.ratio()
    assert ratio is not None and not drift.drifted()
    assert 1 / (1 + noise) - 1e-6 <= ratio <= 1 + noise + 1e-6


@settings(max_examples=60, deadline=None)
@given(skew=st.one_of(st.floats(1.35, 5.0), st.floats(0.1, 0.72)),
       load=st.floats(0.3, 4.0), noise=st.floats(0.0, 0.05), seed=st.integers(0, 2**16))
def test_a_wrong_curve_is_seen_under_any_load(skew: float, load: float, noise: float,
                                              seed: int) -> None:
    drift = CostDrift()
    feed(drift, LEAST_STEPS * 2, load=load, wide_skew=skew, noise=noise, seed=seed)
    assert drift.drifted(), (skew, drift.ratio(), DRIFT)
