"""The event loop's side of the step costs' drift (engine/costdrift.py): once live steps
say the kept costs no longer describe this machine, it says so in the log, once, and
removes the kept file, so that the next start measures them again. The decode thread
only counts; it never logs or touches a file.

While the scheduler runs a generation it looks every `CHECK_S`; idle, it sleeps until
the next one starts. It ends once it has acted: the costs stay as they are for this
daemon's life (a request's drafts must not depend on what was served before it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.engine.costdrift import DRIFT, CostDrift

log = logging.getLogger(__name__)

CHECK_S = 2.0


class CostWatch:
    def __init__(self, drift: CostDrift, scheduler: Scheduler,
                 discard: Callable[[], bool]) -> None:
        """`discard`: removes the kept costs file; True if it removed one (called in a
        worker thread: it touches the disk)."""
        self._drift = drift
        self._scheduler = scheduler
        self._discard = discard

    async def run(self) -> None:
        drift, scheduler = self._drift, self._scheduler
        while True:
            await scheduler.wait_busy()
            busy = True
            while busy:  # (one sleep at least per turn: never a busy loop)
                await asyncio.sleep(CHECK_S)
                if drift.drifted():
                    await self._act()
                    return
                busy = scheduler.busy

    async def _act(self) -> None:
        drift = self._drift
        removed = await asyncio.to_thread(self._discard)
        log.warning(
            "the step costs drafts are judged by no longer fit this machine: steps of "
            "several rows ran %.2fx what they say relative to one-row steps (%d and %d "
            "steps seen; more than %.2fx either way counts); %s", drift.ratio() or 0.0,
            drift.wide_steps, drift.narrow_steps, DRIFT,
            "the kept costs were removed and the next start measures them again" if removed
            else "no kept costs to remove: the next start measures them again")
