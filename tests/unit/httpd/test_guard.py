"""The HTTP listener's defences, on real daemons: a time limit on every phase of a
connection, room kept for real requests beside idle and half-sent connections, web pages
kept out (Host, Origin), `allowed_uids` on HTTP as on the socket, and no byte sequence
that reaches `internal` or leaves a traceback (the property test: test_openai_fuzz.py).

Two daemons, each shared by the module's tests (one event loop): one on loopback TCP with
short time limits, a listed origin and host, and allowed_uids = [0]; one on a Unix socket
with an API key and allowed_uids = [0]. Raw sockets throughout: what is tested is what a
client library hides or refuses to send.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/httpd/test_openai_guard.py.
"""

from __future__ import annotations

import os
import socket


def test_tcp_peer_uid_reads_the_kernel_table() -> None:
    from sfcore_daemon.system.peers import tcp_peer_uid

    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.create_server((host, 0), family=family) as server:
            with socket.create_connection(server.getsockname()[:2]) as client:
                accepted, _ = server.accept()
                with accepted:
                    peer, local = accepted.getpeername()[:2], accepted.getsockname()[:2]
                    assert client.getsockname()[:2] == peer
                    assert tcp_peer_uid(peer, local) == os.geteuid()
                    # No socket on this host is at that address.
                    assert tcp_peer_uid((host, 1), local) is None
