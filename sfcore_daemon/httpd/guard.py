"""Every HTTP connection in a phase with a time limit, and room kept for real requests.

aiohttp parses HTTP and runs the handlers, but of a connection's time it bounds only
the idle spell before a request (`keepalive_timeout`, not moved by a half-sent one) and
nothing else: headers trickled in, a body that never comes, a reply nobody reads. So
`HttpConnection` sits between each transport and aiohttp's `RequestHandler` (the
protocol factory wrapped; aiohttp still does all the parsing), sees bytes arrive and
writes stall, and keeps the connection in one of four phases:

- idle: no byte of a request; closed after `[server] idle_timeout_s`;
- head: a request's first byte came, its headers are not parsed yet; closed after
  `[openai] header_timeout_s`;
- body: headers parsed, the body read here before any handler; 408 and closed after
  `body_timeout_s`;
- busy: a whole request, being answered: as long as it takes (a generation), but a
  write the client leaves untaken for `write_timeout_s` aborts the connection.

`server.max_connections` then bounds what costs: a connection that arrives with the
limit reached has the idle one that waited longest closed for it (or, with none idle,
the oldest still sending a request), so a few hundred sockets that never send a whole
request lock no one out and hold a bounded number of descriptors. Busy connections are
never closed for room; one request past `max_connections` busy ones gets 429.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from sfcore_daemon.config import Config
from sfcore_daemon.core import errors
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.httpd.errors import ApiError

log = logging.getLogger(__name__)

IDLE: Final = "idle"
HEAD: Final = "head"
BODY: Final = "body"
BUSY: Final = "busy"
CLOSED: Final = "closed"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpConnection(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's handler, and tells the pool
    what it sees (bytes in, writes stalled, gone)."""

    __slots__ = ("_pool", "inner", "transport", "phase", "_timer", "_write_timer",
                 "_next_request", "close_after", "peer")

    def __init__(self, pool: ConnectionPool, inner: web.RequestHandler) -> None:
        self._pool = pool
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.phase: str = IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        # Bytes of another request came while this one was answered (pipelining).
        self._next_request = False
        # Close once the reply is written (a refusal, a body left unread).
        self.close_after = False
        # The access check's verdict on the peer, kept for the connection's later
        # requests (httpd/gate.py); None: not checked yet.
        self.peer: str | None = None

    # --- asyncio.Protocol, forwarded ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.inner.connection_made(transport)
        self._pool.opened(self)

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            self._pool.enter(self, HEAD)
        elif self.phase == BUSY:
            self._next_request = True
        self.inner.data_received(data)

    def eof_received(self) -> None:
        # None, as aiohttp's: the transport closes at the client's EOF.
        self.inner.eof_received()

    def pause_writing(self) -> None:
        self._write_timer = self._pool.arm(self._pool.write_s, self._write_stalled)
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_write_timer()
        self._pool.forget(self)
        self.inner.connection_lost(exc)

    # --- the pool's side ---

    @property
    def writing(self) -> bool:
        return self._write_timer is not None

    def set_timer(self, timer: asyncio.TimerHandle | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = timer

    def request_ended(self) -> str:
        """The phase after a reply: another request's bytes already came, or none."""
        pending, self._next_request = self._next_request, False
        return HEAD if pending else IDLE

    def close(self, reason: str, stats: Stats, *, abort: bool = False) -> None:
        stats.http_closed[reason] += 1
        self._pool.forget(self)
        if self.transport is not None:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    def _write_stalled(self) -> None:
        self._write_timer = None
        log.debug("closing an HTTP connection: its client took nothing for "
                  "openai.write_timeout_s")
        self.close("write_timeout", self._pool.stats, abort=True)

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None


class ConnectionPool:
    """The listener's connections by phase, their timers, and the room kept at
    `max_connections`. Event loop only."""

    def __init__(self, config: Config, stats: Stats) -> None:
        self.stats = stats
        self._limit = config.server.max_connections
        self._idle_s = config.server.idle_timeout_s
        self._header_s = config.openai.header_timeout_s
        self._body_s = config.openai.body_timeout_s
        self.write_s = config.openai.write_timeout_s
        self._loop = asyncio.get_running_loop()
        # Oldest first: who is closed when room is needed.
        self._idle: OrderedDict[HttpConnection, None] = OrderedDict()
        self._reading: OrderedDict[HttpConnection, None] = OrderedDict()
        self._busy: set[HttpConnection] = set()
        self._by_handler: dict[web.RequestHandler, HttpConnection] = {}

    def factory(self, make_handler: Callable[[], web.RequestHandler]
                ) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for `loop.create_server`: aiohttp's, wrapped."""
        return lambda: HttpConnection(self, make_handler())

    def arm(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay, callback)

    def opened(self, connection: HttpConnection) -> None:
        self._by_handler[connection.inner] = connection
        self.stats.http_total += 1
        self.enter(connection, IDLE)
        if len(self._by_handler) > self._limit:
            self._make_room(connection)
        self.stats.http_current = len(self._by_handler)

    def enter(self, connection: HttpConnection, phase: str) -> None:
        if connection.phase == CLOSED:
            return
        self._idle.pop(connection, None)
        self._reading.pop(connection, None)
        self._busy.discard(connection)
        connection.phase = phase
        timer = None
        if phase == IDLE:
            self._idle[connection] = None
            if self._idle_s:
                timer = self.arm(self._idle_s, lambda: self._expired(connection, IDLE))
        elif phase == HEAD:
            self._reading[connection] = None
            timer = self.arm(self._header_s, lambda: self._expired(connection, HEAD))
        elif phase == BODY:
            self._reading[connection] = None  # its own timeout is the body read's
        else:
            self._busy.add(connection)
        connection.set_timer(timer)

    def forget(self, connection: HttpConnection) -> None:
        """The connection is closing: out of every count, its timer off. Idempotent."""
        if connection.phase != CLOSED:
            self._idle.pop(connection, None)
            self._reading.pop(connection, None)
            self._busy.discard(connection)
            connection.phase = CLOSED
            connection.set_timer(None)
        self._by_handler.pop(connection.inner, None)
        self.stats.http_current = len(self._by_handler)

    def of(self, request: web.BaseRequest) -> HttpConnection | None:
        return self._by_handler.get(request.protocol)

    def _expired(self, connection: HttpConnection, phase: str) -> None:
        if connection.phase != phase:
            return
        reason = "idle_timeout" if phase == IDLE else "header_timeout"
        log.debug("closing an HTTP connection: %s", reason)
        connection.close(reason, self.stats)

    def _make_room(self, arrived: HttpConnection) -> None:
        for waiting in (self._idle, self._reading):
            for candidate in waiting:
                # A reply still being written is left to its write timeout.
                if candidate is not arrived and not candidate.writing:
                    log.debug("closing an HTTP connection (%s) to make room for a new one: "
                              "server.max_connections (%d) are open", candidate.phase,
                              self._limit)
                    candidate.close("evicted", self.stats)
                    return

    # --- the middlewares: the outermost one, and the body's, after the access checks ---

    @web.middleware
    async def track(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """A request's headers are in: its phase, its reply counted, and after it the
        connection idle again (or closed, when a refusal said so)."""
        connection = self.of(request)
        if connection is None:
            return _gone()
        self.enter(connection, BODY)
        try:
            response = await handler(request)
            transport = connection.transport
            # Not counted: the reply to a client that hung up, or one closed on.
            if transport is not None and not transport.is_closing():
                self.stats.http_response(response.status)
            if connection.close_after:
                response.force_close()
            return response
        finally:
            self.enter(connection, connection.request_ended())

    @web.middleware
    async def read_body(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """The whole body in memory before the handler, within body_timeout_s; then the
        request is busy, and counts against max_connections."""
        connection = self.of(request)
        if connection is None:
            return _gone()
        if request.body_exists:
            await self._read(request, connection)
        self.enter(connection, BUSY)
        if len(self._busy) > self._limit:
            connection.close_after = True
            self.stats.http_closed["refused"] += 1
            self.stats.errors[errors.TOO_MANY_CONNECTIONS] += 1
            raise ApiError.from_code(
                errors.TOO_MANY_CONNECTIONS,
                f"server.max_connections ({self._limit}) HTTP requests are already running")
        return await handler(request)

    async def _read(self, request: web.Request, connection: HttpConnection) -> None:
        try:
            async with asyncio.timeout(self._body_s):
                await request.read()  # kept by aiohttp: the route's read() returns it
        except TimeoutError:
            connection.close_after = True
            self.stats.http_closed["body_timeout"] += 1
            raise ApiError(408, f"the request's body did not arrive within "
                           f"[openai] body_timeout_s ({self._body_s:g} s)", None,
                           "request_timeout") from None
        except web.HTTPRequestEntityTooLarge:
            connection.close_after = True  # rather than reading the rest to throw it away
            raise
        except (HttpProcessingError, web.RequestPayloadError) as exc:
            connection.close_after = True
            raise ApiError(400, f"the request's body cannot be read: {_one_line(exc)}", None,
                           "bad_request") from None


def _gone() -> web.StreamResponse:
    """For a request whose connection was closed (a time limit, room made) before it
    got here: no one is there to read an answer, and nothing of it runs."""
    response = web.Response(status=503)
    response.force_close()
    return response


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


class ServerLog(logging.Logger):
    """The logger aiohttp's server reports through. A request it cannot parse (not
    HTTP, a bad header, broken framing) is the client's doing: aiohttp answers it 400
    and closes, and here it is one debug line and a count, not an error with a
    traceback; so is a client gone mid-reply. Anything else keeps its traceback: it is
    the daemon's own failure."""

    def __init__(self, stats: Stats) -> None:
        super().__init__("sfcore_daemon.openai.http")
        self.parent = log
        self._stats = stats

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        if not self._bad_request(kwargs.get("exc_info", True)):
            super().exception(msg, *args, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        # aiohttp's choice for a first request with a bad method (a TLS hello, a port
        # scan): the same one line, counted.
        if not self._bad_request(kwargs.get("exc_info")):
            super().debug(msg, *args, **kwargs)

    def _bad_request(self, exc_info: object) -> bool:
        error = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(error, ConnectionError):  # the client left mid-reply
            super().debug("an HTTP client left: %s", _one_line(error))
            return True
        if not isinstance(error, HttpProcessingError):
            return False
        self._stats.http_response(error.code or 400)
        if self.isEnabledFor(logging.DEBUG):
            super().debug("answered 400 to a request that is not valid HTTP: %s",
                          _one_line(error))
        return True
