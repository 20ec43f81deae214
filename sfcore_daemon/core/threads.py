"""The event loop's side of adaptive threads: the others' load in, the changes logged.

While the scheduler runs a generation, a task reads the other processes' CPU load
every `SAMPLE_S` (system/cpuload.py) into the engine's `ThreadPolicy.others_cpus`,
a plain float the decode thread reads at the end of each of its windows: the decode
thread itself never reads /proc, logs or waits. Idle, the task sleeps until the next
generation starts (no wake-ups on an idle machine); its first reading, `SAMPLE_S` into
the generation (never on its first step), then covers the idle time. Each change the
decode thread made is logged here, once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from sfcore_daemon.core.counts import ThreadCounts
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.engine.threadpolicy import ThreadPolicy
from sfcore_daemon.system.cpuload import OtherLoad

log = logging.getLogger(__name__)

SAMPLE_S = 0.5


class ThreadMonitor:
    def __init__(self, policy: ThreadPolicy, scheduler: Scheduler, cpus: Sequence[int]) -> None:
        self._policy = policy
        self._scheduler = scheduler
        self._cpus = list(cpus)
        self._logged = 0

    async def run(self) -> None:
        policy, scheduler = self._policy, self._scheduler
        load = OtherLoad(self._cpus)
        load.sample()  # the first reading, for the first generation's first sample
        try:
            while True:
                await scheduler.wait_busy()
                # Not read now: a reading on the first step delays a short prompt's first
                # token (docs/performance/sharing-the-machine.md); nothing stale meanwhile.
                policy.others_cpus = None
                busy = True
                while busy:  # (one sleep at least per turn: never a busy loop)
                    await asyncio.sleep(SAMPLE_S)
                    policy.others_cpus = load.sample()
                    self.log_changes()
                    busy = scheduler.busy
        finally:  # cancelled at shutdown: a change since the last look is logged too
            self.log_changes()

    def log_changes(self) -> None:
        policy = self._policy
        if policy.changes != self._logged:
            self._logged = policy.changes
            log.info("decoding with %d threads (%d batch threads): %s (change %d)",
                     policy.threads, policy.threads_batch, policy.reason, policy.changes)


def thread_counts(policy: ThreadPolicy | None) -> ThreadCounts:
    """The `stats` reply's `threads`: the counts in force (the configured ones before
    the model is loaded)."""
    if policy is None:
        return ThreadCounts(decode=0, batch=0, configured=0, adaptive=False, changes=0)
    return ThreadCounts(decode=policy.threads, batch=policy.threads_batch,
                        configured=policy.limits.full, adaptive=policy.adaptive,
                        changes=policy.changes)
