"""Whether the step costs the drafts are judged by (draftgate.StepCosts) still describe
this machine, from the steps it serves.

The costs are measured once, on a quiet machine, and kept in the cache folder for later
starts (llama/stepcost.py, costsfile.py); a governor, a firmware setting or a one-off bad
measurement can leave them wrong for every start after. Load slows every step alike,
and the gate's choices rest on how a step's time grows with its rows, so what is watched
is a ratio of ratios: wide steps' time (a draft's verification) over their estimate,
against one-row steps' time over theirs. Only steps of the shape the costs were measured
in count: one sequence, no prompt rows, the full thread count. Each kind keeps a moving
mean of its log ratio; once both have seen `LEAST_STEPS` and the ratio is off by more
than `DRIFT` either way, the costs have drifted. The event loop then says so and
discards the kept file, and the next start measures again (core/costwatch.py). Within a
daemon's life the costs stay as they are: a request's drafts must not depend on what
was served before it.

Decode thread: `observe`. Event loop: `ratio`, `drifted` (plain floats and ints; a read
may see one step's update half made, which moves nothing that matters).
"""

from __future__ import annotations

import math

# A step's weight in its kind's mean once that kind has seen 1 / _WEIGHT steps (before,
# the plain mean of what it has seen).
_WEIGHT = 1 / 64
# One step's log ratio counts at most this far from its kind's mean either way: a step
# the scheduler preempted moves the mean little, whatever the machine's load.
_CLIP = 1.0
# Steps of each kind before the ratio says anything.
LEAST_STEPS = 64
# Wide steps this many times dearer (or cheaper) than the costs say, relative to one-row
# steps: the drafts' lengths are then chosen on a wrong curve.
DRIFT = 1.25


class CostDrift:
    """Live step times against the step costs' estimates (see the module)."""

    __slots__ = ("_narrow", "_wide", "narrow_steps", "wide_steps")

    def __init__(self) -> None:
        self._narrow = 0.0  # mean log(elapsed / estimate) of one-row steps
        self._wide = 0.0  # the same of steps of two or more rows
        self.narrow_steps = 0
        self.wide_steps = 0

    def observe(self, rows: int, elapsed_ns: int, estimate_ns: float) -> None:
        """A step of one sequence's `rows` logit rows (no prompt rows, all threads) took
        `elapsed_ns` where the costs said `estimate_ns`."""
        if rows < 1 or elapsed_ns <= 0 or estimate_ns <= 0:
            return
        log_ratio = math.log(elapsed_ns / estimate_ns)
        if rows == 1:
            seen, mean = self.narrow_steps, self._narrow
            self.narrow_steps = seen + 1
            self._narrow = _moved(mean, log_ratio, seen)
        else:
            seen, mean = self.wide_steps, self._wide
            self.wide_steps = seen + 1
            self._wide = _moved(mean, log_ratio, seen)

    def ratio(self) -> float | None:
        """How much dearer wide steps ran than the costs say, relative to one-row steps
        (1.0: as measured); None before both kinds have seen LEAST_STEPS."""
        if self.narrow_steps < LEAST_STEPS or self.wide_steps < LEAST_STEPS:
            return None
        return math.exp(self._wide - self._narrow)

    def drifted(self) -> bool:
        ratio = self.ratio()
        return ratio is not None and not 1 / DRIFT <= ratio <= DRIFT


def _moved(mean: float, log_ratio: float, seen: int) -> float:
    """The mean of `seen` steps with one more."""
    if not seen:
        return log_ratio
    step = min(max(log_ratio - mean, -_CLIP), _CLIP)
    return mean + max(_WEIGHT, 1 / (seen + 1)) * step
