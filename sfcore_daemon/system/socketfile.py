"""The listening socket file: bound (or taken from systemd) before the model loads,
removed at exit only if it is still the file this process bound.

Binding first means a busy or unusable socket path ends start-up before llama.cpp
has read a byte of the model, with one line and nothing left running behind it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass

from sfcore_daemon.system import systemd

log = logging.getLogger(__name__)

# sun_path is 108 bytes on Linux, one of them the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107


class StartupError(Exception):
    """A problem that stops the daemon before it serves; the message is for the user."""


@dataclass(slots=True)
class ListeningSocket:
    sock: socket.socket
    path: str
    # (st_dev, st_ino) of the file we bound; None for a socket systemd owns.
    identity: tuple[int, int] | None

    def remove(self) -> None:
        """Unlink the socket file, unless it is systemd's or another process's by now."""
        if self.identity is None:
            return
        self.identity, identity = None, self.identity
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == identity:
                os.unlink(self.path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("cannot remove %s: %s", self.path, exc.strerror)


def open_listening_socket(path: str, mode: int) -> ListeningSocket:
    """systemd's socket if it passed one, else a new one bound at `path`."""
    activated = systemd.activated_socket()
    if activated is not None:
        return ListeningSocket(activated, activated.getsockname() or path, None)
    return listening_at(path, mode)


def listening_at(path: str, mode: int) -> ListeningSocket:
    """A new socket bound at `path`, with the identity of the file it made."""
    sock = bind_socket(path, mode)
    try:
        info = os.stat(path)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot stat {path} after binding it: {exc.strerror}") from None
    return ListeningSocket(sock, path, (info.st_dev, info.st_ino))


def bind_socket(path: str, mode: int) -> socket.socket:
    """Bind a listening socket at `path` with `mode` from the first instant.

    A live daemon on the path is refused; a stale socket (nothing listening) is
    reclaimed; anything that is not a socket is refused and never deleted.
    """
    size = len(os.fsencode(path))
    if size > _MAX_SOCKET_PATH_BYTES:
        raise StartupError(f"socket path {path} is {size} bytes long; Unix sockets allow at "
                           f"most {_MAX_SOCKET_PATH_BYTES} (choose a shorter server.socket_path)")
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StartupError(f"cannot use socket path {path}: {exc.strerror}") from None
    else:
        if not stat.S_ISSOCK(existing.st_mode):
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        if _is_listening(path):
            raise StartupError(f"another daemon is already listening on {path}")
        log.info("removing stale socket %s", path)
        try:
            os.unlink(path)
        except OSError as exc:
            raise StartupError(f"cannot remove stale socket {path}: {exc.strerror}") from None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The umask, not a chmod after bind, so the file is never more open than `mode`.
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror or exc}") from None
    finally:
        os.umask(old_umask)
    sock.listen(512)
    return sock


def _is_listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as exc:
        raise StartupError(
            f"cannot tell whether {path} is in use: {exc.strerror or exc}") from None
    finally:
        probe.close()
    return True
