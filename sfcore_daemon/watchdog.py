"""systemd's watchdog (WatchdogSec=): `WATCHDOG=1` while the daemon is really serving.

The pings come from a task on the event loop, so a blocked loop stops them by
itself. The decode thread cannot ping (it does nothing but decode), so the task
watches its progress counter instead: while the model loads or a request runs,
a counter that has not moved for a whole watchdog interval means the decode
thread is stuck, and the pings stop until it moves again. systemd then restarts
the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from . import systemd

log = logging.getLogger(__name__)


class StallDetector:
    """Pure logic: is the decode thread stuck, given its counter and a clock?"""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._last_progress: int | None = None
        self._since = 0.0

    def stalled(self, progress: int, busy: bool, now: float) -> bool:
        if progress != self._last_progress or not busy:
            self._last_progress, self._since = progress, now
            return False
        return now - self._since > self.limit_s


class Watchdog:
    def __init__(self, interval_s: float, progress: Callable[[], int],
                 busy: Callable[[], bool]) -> None:
        self.interval_s = interval_s
        self._progress = progress
        self._busy = busy
        self._detector = StallDetector(interval_s)

    @classmethod
    def from_env(cls, progress: Callable[[], int], busy: Callable[[], bool]) -> Watchdog | None:
        """A watchdog if systemd asked for one ($WATCHDOG_USEC, for this pid), else None."""
        pid = os.environ.get("WATCHDOG_PID")
        if pid and pid != str(os.getpid()):
            return None
        try:
            usec = int(os.environ.get("WATCHDOG_USEC", "0"))
        except ValueError:
            return None
        if usec <= 0:
            return None
        return cls(usec / 1e6, progress, busy)

    async def run(self) -> None:
        """Ping at half the interval, as sd_watchdog_enabled(3) advises; until cancelled."""
        stuck = False
        while True:
            now = time.monotonic()
            if self._detector.stalled(self._progress(), self._busy(), now):
                if not stuck:
                    log.error("the decode thread has made no progress for %.1f s; "
                              "no more watchdog pings until it does", now - self._detector._since)
                stuck = True
            else:
                if stuck:
                    log.warning("the decode thread is making progress again")
                stuck = False
                systemd.notify("WATCHDOG=1")
            await asyncio.sleep(self.interval_s / 2)
