"""systemd's watchdog (WatchdogSec=): `WATCHDOG=1` while the daemon is really serving.

The pings come from a task on the event loop, so a blocked loop stops them by
itself. The decode thread cannot ping (it does nothing but decode), so the task
reads its progress counter instead (one int, nothing more): while the model loads
or a request runs, a counter that has not moved for longer than the whole watchdog
interval means the decode thread is stuck, and the pings stop until it moves
again. systemd then kills the service (WatchdogSignal=, SIGABRT by default) and
restarts it (Restart=on-failure).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from sfcore_daemon.system import systemd

log = logging.getLogger(__name__)


class StallDetector:
    """Pure logic: is the decode thread stuck, given its counter and a clock?

    Stuck means: busy, and the counter has shown the same value for longer than
    `limit_s`. Idle time never counts (an idle decode thread makes no progress).
    """

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._last_progress: int | None = None
        self._since = 0.0

    def stalled(self, progress: int, busy: bool, now: float) -> bool:
        if not busy:
            self._last_progress = None  # the next busy check starts the clock afresh
            return False
        if progress != self._last_progress:
            # First seen now (it may have moved up to one check earlier): a stall is
            # never declared before the counter has really stood still for limit_s.
            self._last_progress, self._since = progress, now
            return False
        return now - self._since > self.limit_s

    def stalled_for(self, now: float) -> float:
        """Seconds since the counter was last seen to move (or the work began)."""
        return now - self._since


class Watchdog:
    """Pings `WATCHDOG=1` every half interval unless the decode thread is stuck."""

    def __init__(self, interval_s: float, progress: Callable[[], int],
                 busy: Callable[[], bool],
                 notify: Callable[[str], bool] = systemd.notify) -> None:
        self.interval_s = interval_s
        self._progress = progress
        self._busy = busy
        self._notify = notify
        self._detector = StallDetector(interval_s)
        self.stuck = False

    @classmethod
    def from_env(cls, progress: Callable[[], int], busy: Callable[[], bool]) -> Watchdog | None:
        """A watchdog if systemd asked for one ($WATCHDOG_USEC, for this pid), else None."""
        usec_text = os.environ.get("WATCHDOG_USEC")
        if not usec_text:
            return None
        pid = os.environ.get("WATCHDOG_PID")
        if pid and pid != str(os.getpid()):
            return None  # meant for another process (we were started by one)
        try:
            usec = int(usec_text)
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec_text)
            return None
        if usec <= 0:
            return None
        log.info("systemd watchdog: %.1f s; pinging every %.1f s", usec / 1e6, usec / 2e6)
        return cls(usec / 1e6, progress, busy)

    def tick(self, now: float) -> bool:
        """One check at time `now`: ping unless stuck. True if it pinged."""
        if self._detector.stalled(self._progress(), self._busy(), now):
            if not self.stuck:
                self.stuck = True
                log.error("the decode thread has made no progress for %.1f s; no more "
                          "watchdog pings until it does (systemd will restart the daemon)",
                          self._detector.stalled_for(now))
            return False
        if self.stuck:
            self.stuck = False
            log.warning("the decode thread is making progress again; watchdog pings resume")
        self._notify("WATCHDOG=1")
        return True

    async def run(self) -> None:
        """Check and ping at half the interval, as sd_watchdog_enabled(3) advises; until
        cancelled. A blocked event loop delays this task, so it stops the pings too."""
        while True:
            self.tick(time.monotonic())
            await asyncio.sleep(self.interval_s / 2)
