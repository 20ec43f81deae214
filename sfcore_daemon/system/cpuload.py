"""How much of this process's CPUs other processes use, from the kernel's counters.

Two readings of psutil (the CPUs' busy time from /proc/stat, this process's own CPU
time) a moment apart: what the CPUs were busy with beyond this process is the others'
load, in CPUs (1.0: one core's worth). Steal time counts as busy: a hypervisor that
takes the core away slows the lockstep threads the same way. Event loop only.

`SFCORE_CPU_LOAD_FILE` (for the tests): a file holding the others' load as a number,
read instead of the counters, so that a test decides the load on a machine that
other work keeps busy anyway.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

_LOAD_FILE_ENV = "SFCORE_CPU_LOAD_FILE"


def _busy(times: Any) -> float:
    # guest and guest_nice are already part of user and nice.
    return float(times.user + times.nice + times.system + getattr(times, "irq", 0.0)
                 + getattr(times, "softirq", 0.0) + getattr(times, "steal", 0.0))


class OtherLoad:
    """The others' load on `cpus` between two calls of `sample`."""

    def __init__(self, cpus: Sequence[int]) -> None:
        import psutil  # paid on the first busy moment, not at start-up

        self._psutil = psutil
        self._process = psutil.Process()
        self._cpus = list(cpus)
        self._file = os.environ.get(_LOAD_FILE_ENV) or None
        self._last: tuple[float, float, float] | None = None

    def sample(self) -> float | None:
        """The others' load in CPUs since the last call; None on the first call, or
        when the counters cannot be read."""
        if self._file is not None:
            return self._from_file(self._file)
        try:
            per_cpu = self._psutil.cpu_times(percpu=True)
            own = self._process.cpu_times()
        except (OSError, self._psutil.Error):
            self._last = None
            return None
        busy = sum(_busy(per_cpu[cpu]) for cpu in self._cpus if cpu < len(per_cpu))
        reading = (time.monotonic(), busy, float(own.user + own.system))
        last, self._last = self._last, reading
        if last is None or reading[0] <= last[0]:
            return None
        others = float((reading[1] - last[1]) - (reading[2] - last[2])) / (reading[0] - last[0])
        return min(float(len(self._cpus)), max(0.0, others))

    @staticmethod
    def _from_file(path: str) -> float | None:
        try:
            with open(path, encoding="ascii") as file:
                return max(0.0, float(file.read().strip()))
        except (OSError, ValueError):
            return None
