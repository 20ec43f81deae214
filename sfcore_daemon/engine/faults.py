"""Fault injection for the tests (environment variable SFCORE_FAILPOINT), read once.

A comma-separated list of points. "decode_hang": the decode thread stops making
progress when it starts the next generation (the watchdog's tests). "POINT@N": the
named point raises `InjectedFault` while it serves a request whose max_tokens is N,
so a test picks the one request it breaks. The points:

- "decode_thread": the step loop itself, as the request begins: the decode thread dies;
- "drafter": the request's drafter (speculative.py), when it proposes a draft;
- "keep": the prompt store taking a state of the request's cells;
- "restore": the prompt store once it has restored a state for the request's prompt
  from RAM, or started reading one from disk;
- "closer": the grammar's draw, when the request's JSON closer (closer.py) rides along;
- "end": ending the request, before its slot's state is kept.

"warmup_trap" (read by llama/selfcheck.py): the warm-up decode dies of SIGILL, as a
llama.cpp build that cannot run on this CPU does.

Unset (as in production) every check is one comparison with an empty dict.
"""

from __future__ import annotations

import os

from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.speculative import NgramDrafter


class InjectedFault(MemoryError):
    """What an armed point raises: a MemoryError, the failure a copy of a state or an
    index of n-grams may really meet."""


def _parse(spec: str) -> tuple[bool, dict[str, int]]:
    hang, armed = False, {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, value = item.partition("@")
        if point == "decode_hang":
            hang = True
        elif value.isdigit():
            armed[point] = int(value)
    return hang, armed


DECODE_HANG, _ARMED = _parse(os.environ.get("SFCORE_FAILPOINT", ""))


def armed(point: str, job: Job | None) -> bool:
    """Whether `point` is to fail for `job`."""
    return bool(_ARMED) and job is not None and _ARMED.get(point) == job.spec.max_tokens


def hit(point: str, job: Job | None) -> None:
    """Raise InjectedFault when `point` is armed for `job`."""
    if _ARMED and armed(point, job):
        raise InjectedFault(f"injected fault at {point} (SFCORE_FAILPOINT)")


def drafter(job: Job) -> type[NgramDrafter]:
    """The drafter class for `job`: one whose proposals fail where "drafter" is armed."""
    return _FailingDrafter if armed("drafter", job) else NgramDrafter


class _FailingDrafter(NgramDrafter):
    __slots__ = ()

    def _propose(self, room: int) -> tuple[list[int], int]:
        raise InjectedFault("injected fault at drafter (SFCORE_FAILPOINT)")
