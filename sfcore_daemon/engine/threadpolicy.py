"""How many threads to decode with, from each step's time and the other processes' load.

ggml's threads run in lockstep: a barrier after every graph node. When another process
holds one of the cores, one decode thread waits for the scheduler while its partner
waits at the barrier, and a token takes several times as long as on an idle machine;
fewer threads, each with a core of its own, then decode faster. `ThreadPolicy` is the
pure logic of that choice (a clock passed in, nothing read or logged here): the decode
thread feeds it each decode step's time and applies what it says between steps (with
OpenMP, `llama_set_n_threads` only changes the next graph's team size); the event loop
writes the other processes' load into `others_cpus` (core/threads.py) and logs the
changes it sees in `changes`.

Down: the steps of a window are stretched past `stretch` times the idle baseline and
the others' load leaves fewer cores than threads (by half a core). Up: the load leaves
room for one more thread (with a quarter core to spare). Either only after `confirm`
windows in a row and `dwell_ns` since the last change; a step down soon after a step
up doubles the dwell before the next step up (to `max_dwell_ns`), so a load that comes
and goes with each probe cannot make the count oscillate.

A step down is a trial: whether fewer threads decode faster beside a given load depends
on the machine and the spin window (with a short one, two threads beside one busy
process may still beat one). The first window after it is compared with the last one
before; slower steps put the count back at once, and no step down follows for
`hold_ns` (doubled after each failed trial, up to `max_hold_ns`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MS = 1_000_000
_S = 1_000_000_000

# Load margins, in CPUs: down when the room left is below `threads - _DOWN_MARGIN`;
# up when it reaches `threads + 1 - _UP_MARGIN`. The band between them holds.
_DOWN_MARGIN = 0.5
_UP_MARGIN = 0.25


@dataclass(frozen=True, slots=True)
class ThreadLimits:
    full: int  # decode threads configured (the count on an idle machine)
    full_batch: int  # batch threads configured
    cpus: int  # CPUs this process may run on
    stretch: float = 1.5  # a window's mean step this much over the baseline is stretched
    window_ns: int = 500 * _MS
    confirm: int = 2  # windows in a row that must agree before a change
    dwell_ns: int = 3 * _S  # at least this long between changes
    max_dwell_ns: int = 60 * _S
    hold_ns: int = 30 * _S  # no step down for this long after a failed trial
    max_hold_ns: int = 600 * _S


class ThreadPolicy:
    """The thread counts in force and when to change them. Decode thread (`step`),
    except `others_cpus`, which the event loop writes (a plain float, or None while
    it has no fresh sample)."""

    def __init__(self, limits: ThreadLimits, adaptive: bool = True) -> None:
        self.limits = limits
        self.adaptive = adaptive and limits.full > 1
        self.threads = limits.full
        self.threads_batch = limits.full_batch
        self.changes = 0  # plain int: the loop logs each change it sees
        self.others_cpus: float | None = None
        # Why the last change was made, for the loop's log line.
        self.reason = ""
        # The mean step at full threads on a quiet machine (ns), once seen.
        self.baseline_ns: float | None = None
        self._sum_ns = 0
        self._steps = 0
        self._window_end: int | None = None
        self._direction = 0  # where the last windows asked to go: -1 down, 1 up
        self._agreeing = 0
        self._last_change: int | None = None
        self._last_up: int | None = None
        self._up_dwell = limits.dwell_ns
        # During a trial (after a step down): the count before it and its last mean step.
        self._trial: tuple[int, float] | None = None
        self._hold_until = 0
        self._hold_ns = limits.hold_ns

    def step(self, elapsed_ns: int, now_ns: int) -> bool:
        """One decode step (no prompt rows) took `elapsed_ns`; True when the counts
        in force changed and the caller must apply them before the next step."""
        if not self.adaptive:
            return False
        self._sum_ns += elapsed_ns
        self._steps += 1
        end = self._window_end
        if end is None:
            self._window_end = now_ns + self.limits.window_ns
            return False
        if now_ns < end:
            return False
        # A window spans the idle time between requests (only steps' times count), so
        # many short requests decide as one long one does.
        mean = self._sum_ns / self._steps
        self._sum_ns = self._steps = 0
        self._window_end = now_ns + self.limits.window_ns
        return self._window(mean, now_ns)

    def _window(self, mean_ns: float, now: int) -> bool:
        limits = self.limits
        if self._trial is not None:
            return self._judge_trial(mean_ns, now)
        others = self.others_cpus
        if others is None:
            return False
        room = limits.cpus - others
        if self.threads == limits.full and room >= limits.full - _UP_MARGIN:
            # Quiet enough to measure the baseline: fast down, slow up (contexts grow).
            base = self.baseline_ns
            self.baseline_ns = mean_ns if base is None or mean_ns < base else (
                0.9 * base + 0.1 * mean_ns)
        want = self._wanted(room, mean_ns)
        direction = (want > self.threads) - (want < self.threads) if want else 0
        if direction == 0:
            self._direction = self._agreeing = 0
            return False
        if direction == self._direction:
            self._agreeing += 1
        else:
            self._direction, self._agreeing = direction, 1
        if self._agreeing < limits.confirm:
            return False
        dwell = self._up_dwell if direction > 0 else limits.dwell_ns
        if self._last_change is not None and now - self._last_change < dwell:
            return False
        if direction < 0 and now < self._hold_until:
            return False
        if direction < 0:
            self._trial = (self.threads, mean_ns)
        self._change(want, now, f"other processes use {others:.1f} of {limits.cpus} CPUs")
        return True

    def _judge_trial(self, mean_ns: float, now: int) -> bool:
        """The first window after a step down: keep the count if its steps are no
        slower than before it, else go back (an exception to the dwell)."""
        assert self._trial is not None
        before, before_ns = self._trial
        self._trial = None
        if mean_ns <= before_ns:
            self._hold_ns = self.limits.hold_ns
            return False
        self._hold_until = now + self._hold_ns
        self._hold_ns = min(self.limits.max_hold_ns, 2 * self._hold_ns)
        self._change(before, now, f"{self.threads} threads decoded no faster "
                     f"({mean_ns / 1e6:.1f} against {before_ns / 1e6:.1f} ms a step)")
        return True

    def _wanted(self, room: float, mean_ns: float) -> int:
        """The count this window asks for, or 0 for the one in force."""
        threads, limits = self.threads, self.limits
        if room < threads - _DOWN_MARGIN and threads > 1:
            base = self.baseline_ns
            if base is not None and mean_ns <= limits.stretch * base:
                return 0  # the others' load does not slow the steps: keep the cores
            return max(1, min(threads - 1, math.floor(room + 0.5)))
        if room >= threads + 1 - _UP_MARGIN and threads < limits.full:
            return min(limits.full, math.floor(room + _UP_MARGIN))
        return 0

    def _change(self, want: int, now: int, reason: str) -> None:
        limits = self.limits
        if want < self.threads and self._last_up is not None and (
                now - self._last_up < 2 * self._up_dwell):
            # The load came back right after a step up: probe less often.
            self._up_dwell = min(limits.max_dwell_ns, 2 * self._up_dwell)
        elif want < self.threads:
            self._up_dwell = limits.dwell_ns
        if want > self.threads:
            self._last_up = now
        self.threads = want
        # Batch threads (drafts and prompt chunks run as batches) give up as many.
        self.threads_batch = max(1, limits.full_batch - (limits.full - want))
        self.reason = reason
        self._last_change = now
        self._direction = self._agreeing = 0
        self.changes += 1
