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

"cheap_wide_steps": the step costs the drafts are judged by say that a step of any width
costs what a one-row step does, as a bad measurement kept from an earlier start would
(the drift check's tests: engine/costdrift.py).

Unset (as in production) every check is one comparison with an empty dict.
"""

from __future__ import annotations

import os

from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.speculative import NgramDrafter


class InjectedFault(MemoryError):
    """What an armed point raises: a MemoryError, the failure a copy of a state or an
    index of n-grams may really meet."""


def _parse(spec: str) -> tuple[set[str], dict[str, int]]:
    flags, armed = set(), {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, value = item.partition("@")
        if point in {"decode_hang", "cheap_wide_steps"}:
            flags.add(point)
        elif value.isdigit():
            armed[point] = int(value)
    return flags, armed


_FLAGS, _ARMED = _parse(os.environ.get("SFCORE_FAILPOINT", ""))
DECODE_HANG = "decode_hang" in _FLAGS


def step_costs(measured: dict[int, float]) -> dict[int, float]:
    """The step costs as "cheap_wide_steps" leaves them (else as they are): every width
    at the one-row step's time, the cost per cell of context (key 0) kept."""
    if "cheap_wide_steps" not in _FLAGS or 1 not in measured:
        return measured
    return {rows: ns if rows <= 1 else measured[1] for rows, ns in measured.items()}


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
