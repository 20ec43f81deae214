"""Who may use the HTTP listener: the peer's uid (one policy with the NDJSON socket),
and no web page unless configured (Host and Origin).

- `[server] allowed_uids` / `allowed_gids` (core/access.py): on a Unix listener the
  peer's uid and groups come from SO_PEERCRED and SO_PEERGROUPS, as on the socket; on
  TCP from the kernel's socket table (system/peers.py), groups from the user database.
  A refused peer gets 403 and its connection is closed.
- A browser can be made to send requests to a loopback port by any page it shows: a
  form or a `fetch` without preflight (with an `Origin` header naming the page), or a
  DNS-rebinding page whose own name resolves to 127.0.0.1 (with its name in `Host`,
  and able to read the reply). So on a loopback or Unix listener `Host` must name
  localhost, 127.0.0.1 or [::1] (with the listener's port, or none) unless
  `[openai] allowed_hosts` lists it, and on every listener a request with an `Origin`
  other than the listener's own is refused unless `allowed_origins` lists it. Listed
  origins get CORS headers (and their preflight an answer); no one else does.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from sfcore_daemon.config import Config
from sfcore_daemon.core import access, errors
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.httpd.guard import ConnectionPool, HttpConnection
from sfcore_daemon.system.peers import peer_credentials, peer_groups, tcp_peer_uid, user_groups

LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
_ALLOWED = ""  # the peer check's verdict for a peer that may go on
# What a preflight's Access-Control-Request-Headers may list to be echoed back.
_HEADER_LIST = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gate:
    """The listener's access checks, as a middleware (and CORS as a response hook)."""

    def __init__(self, config: Config, sock: socket.socket, pool: ConnectionPool) -> None:
        self._server = config.server
        self._pool = pool
        self._unix = sock.family == socket.AF_UNIX
        openai = config.openai
        address = openai.address
        hosts = {host.lower() for host in openai.allowed_hosts}
        self._any_host = "*" in hosts
        self._check_host = not self._any_host and (
            bool(hosts) or address is None or address.is_loopback)
        # Exact `Host` values, and names taken with any port.
        self._host_values = {host for host in hosts if _split_host(host)[1]}
        self._host_names = {host for host in hosts if not _split_host(host)[1]}
        if self._unix:
            self._host_names.update(LOOPBACK_NAMES)
        elif address is not None and address.is_loopback:
            port = sock.getsockname()[1]
            self._host_values.update(LOOPBACK_NAMES)  # no port: as port 80 is written
            self._host_values.update(f"{name}:{port}" for name in LOOPBACK_NAMES)
        origins = {origin.lower() for origin in openai.allowed_origins}
        self._any_origin = "*" in origins
        self._origins = origins

    # --- the middleware ---

    @web.middleware
    async def check(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        connection = self._pool.of(request)
        if access.restricted(self._server):
            verdict = connection.peer if connection is not None else None
            if verdict is None:
                verdict = await self._peer_verdict(request)
                if connection is not None:
                    connection.peer = verdict
            if verdict != _ALLOWED:
                self._refuse(connection)
                raise ApiError(403, verdict, None, "forbidden")
        host = request.headers.get("Host")
        why = self._host_refusal(host) or self._origin_refusal(
            request.headers.get("Origin"), host)
        if why is not None:
            self._refuse(connection)
            raise ApiError(403, why, None, "forbidden")
        if request.method == "OPTIONS" and self._cors_origin(request) is not None \
                and "Access-Control-Request-Method" in request.headers:
            return self._preflight(request)
        return await handler(request)

    def _refuse(self, connection: HttpConnection | None) -> None:
        if connection is not None:
            connection.close_after = True
            self._pool.stats.http_closed["refused"] += 1
        self._pool.stats.errors[errors.FORBIDDEN] += 1

    # --- the peer ---

    async def _peer_verdict(self, request: web.Request) -> str:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return "the connection closed before its peer could be checked"
        if self._unix:
            creds = peer_credentials(sock)
            if creds is None:
                return "cannot read the peer's credentials"
            _, uid, gid = creds
            return access.refusal(self._server, uid, gid, lambda: peer_groups(sock)) \
                or _ALLOWED
        peer, local = sock.getpeername()[:2], sock.getsockname()[:2]
        # The socket table and the user database are files (or NSS): off the loop.
        return await asyncio.to_thread(self._tcp_verdict, peer, local)

    def _tcp_verdict(self, peer: tuple[str, int], local: tuple[str, int]) -> str:
        uid = tcp_peer_uid(peer, local)
        if uid is None:
            return (f"the peer {peer[0]} port {peer[1]} has no socket on this host: "
                    "server.allowed_uids admits local users only")
        gid, groups = user_groups(uid)
        return access.refusal(self._server, uid, gid, lambda: groups) or _ALLOWED

    # --- Host and Origin ---

    def _host_refusal(self, host: str | None) -> str | None:
        if not self._check_host or host is None:  # no Host: HTTP/1.0, not a browser
            return None
        value = host.lower()
        if value in self._host_values or _split_host(value)[0] in self._host_names:
            return None
        return (f"Host {_shown(host)} is not this listener's address: add it to "
                "[openai] allowed_hosts to serve requests sent to that name")

    def _origin_refusal(self, origin: str | None, host: str | None) -> str | None:
        if origin is None or self._any_origin or origin.lower() in self._origins:
            return None
        if host is not None and origin.lower() == f"http://{host.lower()}":
            return None  # the listener's own origin
        return (f"requests from web pages (Origin {_shown(origin)}) are refused: add the "
                "origin to [openai] allowed_origins to serve it")

    # --- CORS, for the listed origins only ---

    def _cors_origin(self, request: web.BaseRequest) -> str | None:
        origin = request.headers.get("Origin")
        if origin is None or not (self._any_origin or origin.lower() in self._origins):
            return None
        return origin

    def _preflight(self, request: web.Request) -> web.StreamResponse:
        response = web.Response(status=204)
        asked = request.headers.get("Access-Control-Request-Headers", "")
        response.headers["Access-Control-Allow-Methods"] = "GET, POST"
        if _HEADER_LIST.match(asked):
            response.headers["Access-Control-Allow-Headers"] = asked
        response.headers["Access-Control-Max-Age"] = "600"
        return response

    async def add_cors_headers(self, request: web.BaseRequest,
                               response: web.StreamResponse) -> None:
        """aiohttp's on_response_prepare: every reply to a listed origin, streamed ones
        included."""
        origin = self._cors_origin(request)
        if origin is not None and origin.isascii() and origin.isprintable():
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"


def _split_host(value: str) -> tuple[str, str]:
    """`name:port` -> (name, port); `[v6]:port` keeps its brackets; no port: ''."""
    if value.startswith("["):
        name, _, rest = value.partition("]")
        return name + "]", rest.removeprefix(":")
    name, colon, port = value.rpartition(":")
    return (name, port) if colon else (value, "")


def _shown(text: str) -> str:
    """A header's value in a message: quoted, anything odd escaped (its bytes may be
    anything, and the reply is JSON)."""
    return ascii(text[:200])
