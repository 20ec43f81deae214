"""ThreadPolicy's logic (engine/threadpolicy.py) on a fake clock: when the decode thread
count goes down, when it comes back, and that it never oscillates.

The daemon's side (the count applied, `stats`, `/metrics`, `adaptive_threads = false`)
is tests/e2e/ndjson/test_adaptive_threads.py.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.engine.threadpolicy import ThreadLimits, ThreadPolicy

MS = 1_000_000
S = 1_000 * MS
TWO_CORES = ThreadLimits(full=2, full_batch=2, cpus=2)


class Drive:
    """Decode steps of a given length on a fake clock, with the others' load set."""

    def __init__(self, policy: ThreadPolicy) -> None:
        self.policy = policy
        self.now = 0
        self.changed_at: list[int] = []

    def run(self, seconds: float, step_ms: float | dict[int, float],
            others: float | None) -> None:
        """`step_ms`: one length, or one per thread count."""
        self.policy.others_cpus = others
        end = self.now + int(seconds * S)
        while self.now < end:
            length = step_ms if isinstance(step_ms, float | int) else (
                step_ms[self.policy.threads])
            step = int(length * MS)
            self.now += step
            if self.policy.step(step, self.now):
                self.changed_at.append(self.now)


def test_short_requests_with_idle_time_between_decide_as_a_long_one() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    for others, step_ms in ((0.0, 8), (1.0, 30), (0.0, 12)):
        for _ in range(20):  # 0.3 s of decoding, then 2 s idle
            drive.run(0.3, step_ms, others)
            drive.now += 2 * S
    assert drive.policy.changes == 2 and drive.policy.threads == 2


def test_a_quiet_machine_keeps_every_thread() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(60, 8, 0.1)
    assert drive.policy.threads == 2 and drive.policy.changes == 0
    assert drive.policy.baseline_ns == 8 * MS


def test_a_busy_process_takes_a_thread_and_gives_it_back() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.05)  # the idle baseline: 8 ms a step
    drive.run(5, 30, 0.9)  # a busy process: steps 3.75x as long
    policy = drive.policy
    assert (policy.threads, policy.threads_batch, policy.changes) == (1, 1, 1)
    assert policy.reason == "other processes use 0.9 of 2 CPUs"
    drive.run(20, 12, 1.0)  # still there: one thread stays
    assert policy.threads == 1 and policy.changes == 1
    drive.run(10, 12, 0.05)  # gone: back up
    assert (policy.threads, policy.threads_batch, policy.changes) == (2, 2, 2)


def test_a_load_that_does_not_slow_the_steps_changes_nothing() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.0)
    drive.run(30, 10, 0.9)  # 1.25x: below the stretch threshold
    assert drive.policy.threads == 2 and drive.policy.changes == 0


def test_without_a_baseline_the_load_alone_decides() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 30, 1.0)  # busy from the first request on
    assert drive.policy.threads == 1 and drive.policy.baseline_ns is None


def test_turned_off_it_never_changes() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES, adaptive=False))
    drive.run(5, 8, 0.0)
    drive.run(30, 40, 2.0)
    assert drive.policy.threads == 2 and drive.policy.changes == 0


def test_one_thread_has_nothing_to_give() -> None:
    drive = Drive(ThreadPolicy(ThreadLimits(full=1, full_batch=2, cpus=2)))
    drive.run(30, 40, 2.0)
    assert not drive.policy.adaptive and drive.policy.threads == 1


def test_no_sample_no_decision() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(30, 40, None)
    assert drive.policy.changes == 0


def test_one_window_is_not_enough() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.0)
    drive.run(0.6, 30, 1.0)  # one window of load, then quiet again
    drive.run(10, 8, 0.0)
    assert drive.policy.changes == 0


def test_the_band_between_the_margins_holds_either_count() -> None:
    # Down needs others > 0.5 on 2 cores with 2 threads; up needs others <= 0.25.
    for others in (0.3, 0.4, 0.5):
        drive = Drive(ThreadPolicy(TWO_CORES))
        drive.run(5, 8, 0.0)
        drive.run(30, 30, others)
        assert drive.policy.threads == 2, others
        drive.run(5, 30, 1.0)
        assert drive.policy.threads == 1
        drive.run(30, 12, others)
        assert drive.policy.threads == 1, others


def test_a_larger_machine_gives_up_what_the_others_take() -> None:
    drive = Drive(ThreadPolicy(ThreadLimits(full=8, full_batch=16, cpus=8)))
    drive.run(5, 8, 0.0)
    drive.run(5, 30, 2.0)
    assert (drive.policy.threads, drive.policy.threads_batch) == (6, 14)
    drive.run(10, 10, 0.1)
    assert drive.policy.threads == 8


def test_a_load_that_returns_with_every_probe_is_probed_less_and_less() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.0)
    for _ in range(12):  # 4 minutes: the load leaves for 4 s, then comes back for 16
        drive.run(4, 12, 0.0)
        drive.run(16, 30, 1.0)
    gaps = [b - a for a, b in zip(drive.changed_at, drive.changed_at[1:], strict=False)]
    ups = drive.changed_at[1::2]
    # Every probe up is followed by a step down; their number shrinks as the dwell
    # doubles (at most one a dwell: 3, 6, 12, ... s).
    assert drive.policy.changes <= 12
    assert all(gap >= TWO_CORES.dwell_ns for gap in gaps)
    assert len(ups) < 6


def test_fewer_threads_that_decode_no_faster_are_put_back_and_tried_less_often() -> None:
    # Beside this load two threads (20 ms a step) beat one (25 ms): each step down is
    # undone one window later, and the next trial waits 30, then 60, then 120 s.
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.0)
    drive.run(300, {2: 20.0, 1: 25.0}, 1.0)
    policy = drive.policy
    assert policy.threads == 2 and policy.changes == 8
    downs, backs = drive.changed_at[::2], drive.changed_at[1::2]
    assert all(back - down <= 2 * TWO_CORES.window_ns for down, back in zip(
        downs, backs, strict=True))
    holds = [down - back for back, down in itertools.pairwise(drive.changed_at[1:])][::2]
    assert [round(hold / S) for hold in holds] == [30, 60, 120]
    assert policy.reason == "1 threads decoded no faster (25.0 against 20.0 ms a step)"


def test_a_trial_that_pays_off_keeps_the_count_and_resets_the_hold() -> None:
    drive = Drive(ThreadPolicy(TWO_CORES))
    drive.run(5, 8, 0.0)
    drive.run(30, {2: 30.0, 1: 12.0}, 1.0)
    assert drive.policy.threads == 1 and drive.policy.changes == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 3.0), st.floats(1.0, 80.0) | st.fixed_dictionaries(
                              {n: st.floats(1.0, 80.0) for n in range(1, 9)}),
                          st.one_of(st.none(), st.floats(0.0, 2.0))),
                min_size=1, max_size=40),
       st.integers(1, 8), st.integers(1, 8))
def test_never_oscillates_and_stays_in_range(phases: list[tuple[float, float, float | None]],
                                             full: int, cpus: int) -> None:
    limits = ThreadLimits(full=full, full_batch=full + 1, cpus=cpus)
    drive = Drive(ThreadPolicy(limits))
    for seconds, step_ms, others in phases:
        drive.run(seconds, step_ms, others)
        policy = drive.policy
        assert 1 <= policy.threads <= full
        assert policy.threads_batch == limits.full_batch - (full - policy.threads)
    times = drive.changed_at
    # Apart from a failed trial's immediate return, changes are a dwell apart.
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(gap >= limits.dwell_ns or gap <= 2 * limits.window_ns for gap in gaps)
    assert all(a >= limits.dwell_ns for a, b in itertools.pairwise(gaps)
               if b <= 2 * limits.window_ns) or len(gaps) < 2
    assert drive.policy.changes == len(times)
