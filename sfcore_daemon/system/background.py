"""Background threads that must never take a core from the decode.

On a 2-core machine the decode's threads use both cores for the whole of a request, so
any other CPU work in the process lands inside its steps. Writing a prompt state to
disk is such work: a 16 MB state is a CRC and a copy into the page cache (its cost, and
the fsync's that is gone: docs/performance/prompt-store.md). Those writes can wait for an
idle moment: the state is in RAM (or dropped) until then.
"""

from __future__ import annotations

import os

# A nice value as close to idle as one goes where SCHED_IDLE is missing.
_LOWEST_NICE = 19


def run_when_idle() -> str:
    """Make the calling thread run only on a core nothing else wants: SCHED_IDLE (Linux;
    the thread still gets a sliver under full load, so its work finishes), else the
    lowest nice value. Lowering one's own priority needs no privilege. Returns what
    was set ("" when neither could be)."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is not None:
        try:
            # pid 0: the calling thread (Linux schedules threads, not processes).
            os.sched_setscheduler(0, policy, os.sched_param(0))
            return "SCHED_IDLE"
        except OSError:
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, _LOWEST_NICE)
        return f"nice {_LOWEST_NICE}"
    except OSError:
        return ""
