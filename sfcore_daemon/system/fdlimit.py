"""The file-descriptor budget, checked once at start-up.

Every connection holds a descriptor, and so do the prompt store's files, the model,
the listeners and the loop's own. Run out, and the next accept, state file or log
write fails wherever it happens to be; so the daemon knows at start-up what its limits
can cost and makes sure RLIMIT_NOFILE covers it: the soft limit is raised to the hard
one when that is enough (what systemd asks of programs that need more than 1024), and
start-up stops with one line when even the hard limit is too low.
"""

from __future__ import annotations

import logging
import resource

from sfcore_daemon.system.socketfile import StartupError

log = logging.getLogger(__name__)

# Descriptors beyond the connections (listeners, the loop's, logs, the model file, the
# prompt store, llama.cpp, Python): a use well under half of this was measured.
MARGIN = 64


def ensure_descriptors(connections: int, what: str) -> None:
    """Make RLIMIT_NOFILE allow `connections` open connections (`what` says whose,
    for the log line) plus MARGIN; StartupError if the hard limit does not."""
    needed = connections + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        log.info("file descriptors: %d at most (%s, plus %d), limit %s", needed, what,
                 MARGIN, "unlimited" if soft == resource.RLIM_INFINITY else soft)
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise StartupError(
            f"the file descriptor limit (RLIMIT_NOFILE, hard {hard}) is below the {needed} "
            f"the daemon may need ({what}, plus {MARGIN}): lower server.max_connections "
            "or raise LimitNOFILE= (ulimit -n)")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        raised = hard
    except (OSError, ValueError):  # an unlimited hard limit may exceed fs.nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        raised = needed
    log.info("file descriptors: %d at most (%s, plus %d); soft limit raised from %d to %d",
             needed, what, MARGIN, soft, raised)
