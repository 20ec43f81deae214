"""Who is at the other end of a loopback TCP connection: the uid that owns the peer's
socket, read from the kernel's socket tables (/proc/net/tcp and tcp6).

A Unix socket has SO_PEERCRED; TCP has nothing like it, but on one host both ends are
sockets in the same table, and each row names its owner (the uid that created the
socket, as SO_PEERCRED names the one that connected). The peer's row is the one whose
local address is the peer's and whose remote address is ours. A peer on another host
has no row here: its uid is unknown (None), and a listener restricted to some uids
refuses it.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import pwd
import socket
import struct
from typing import Any

# SO_PEERGROUPS (Linux 4.13+): the peer's supplementary groups at connect time.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# Rows that are not a live peer: a TIME_WAIT row has no owner (uid 0, which reads as
# root) and may repeat a closed connection's addresses; a listener has no peer.
_NOT_A_PEER = {b"06", b"0A"}


def _row_address(host: str, port: int, v6: bool) -> bytes:
    """An address as the table prints it: the raw 32-bit words in host order, in hex."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if v6:
        if address.version == 4:
            address = ipaddress.IPv6Address(f"::ffff:{address}")
        words = struct.unpack("=4I", address.packed)
        text = "".join(f"{word:08X}" for word in words)
    else:
        if address.version == 6:
            mapped = address.ipv4_mapped
            if mapped is None:
                raise ValueError(host)
            address = mapped
        (word,) = struct.unpack("=I", address.packed)
        text = f"{word:08X}"
    return f"{text}:{port:04X}".encode()


def tcp_peer_uid(peer: tuple[str, int], local: tuple[str, int]) -> int | None:
    """The uid owning the socket at `peer` that is connected to our `local` address, or
    None if no socket on this host is (a remote peer, or one already gone)."""
    for table in _TABLES:
        v6 = table.endswith("6")
        try:
            needle = b" " + _row_address(*peer, v6) + b" " + _row_address(*local, v6) + b" "
        except ValueError:  # an IPv6 peer has no row in the IPv4 table
            continue
        try:
            with open(table, "rb") as rows:
                data = rows.read()
        except OSError:
            continue
        start = data.find(needle)
        while start >= 0:
            line_end = data.find(b"\n", start)
            fields = data[start:line_end if line_end >= 0 else None].split()
            # local, remote, state, tx:rx queues, timer, retransmits, uid
            if len(fields) > 6 and fields[2] not in _NOT_A_PEER:
                return int(fields[6])
            start = data.find(needle, start + 1)
    return None


def user_groups(uid: int) -> tuple[int, set[int]]:
    """A uid's primary group and its groups in the user database (what a TCP peer's
    groups are taken to be: its process's own are not in the table); (-1, set()) for
    a uid the database does not know."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return -1, set()
    try:
        return user.pw_gid, set(os.getgrouplist(user.pw_name, user.pw_gid))
    except OSError:
        return user.pw_gid, set()


def peer_credentials(sock: Any) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the peer process, from SO_PEERCRED."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def peer_groups(sock: Any) -> set[int]:
    """The peer's supplementary groups (SO_PEERGROUPS); empty if the kernel can't say."""
    size = 4 * 64
    while size <= 4 * 65536:
        try:
            data = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                size *= 4
                continue
            return set()
        return set(struct.unpack(f"{len(data) // 4}I", data[: len(data) // 4 * 4]))
    return set()
