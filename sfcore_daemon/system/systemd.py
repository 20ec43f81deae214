"""The two pieces of systemd integration the daemon needs, without libsystemd:
readiness notification (Type=notify) and socket activation (LISTEN_FDS)."""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1") to $NOTIFY_SOCKET; False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True


def activated_socket() -> socket.socket | None:
    """The listening socket passed by systemd socket activation, if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        count = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if count < 1:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # not for our children
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.set_inheritable(False)
    return sock
