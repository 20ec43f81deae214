"""Every HTTP connection in a phase with a time limit, and room kept for real requests.

aiohttp parses HTTP and runs the handlers, but of a connection's time it bounds only
the idle spell before a request (`keepalive_timeout`, not moved by a half-sent one) and
nothing else: headers trickled in, a body that never comes, a reply nobody reads. So
`HttpConnection` sits between each transport and aiohttp's `RequestHandler` (the
protocol factory wrapped; aiohttp still does all the parsing), sees bytes arrive and
writes stall, and keeps the connection in one of five phases:

- idle: no byte of a request; closed after `[openai] first_request_timeout_s` before the
  first request (nginx's `client_header_timeout`), `[server] idle_timeout_s` between two;
- head: a request's first byte came, its headers are not parsed yet; closed after
  `[openai] header_timeout_s`;
- body: headers parsed, the body read here before any handler; 408 and closed after
  `body_timeout_s`;
- busy: a whole request, being answered: as long as it takes (a generation), but a
  write the client leaves untaken for `write_timeout_s` aborts the connection;
- lingering: answered before its request's body was all read (a 413, a 403, a 408), and
  closing. Closing at once with the body's rest unread would have the kernel reset the
  connection, and a client still sending then sees the reset, not the answer. So, as
  nginx's `lingering_close`, the reply is followed by a FIN (the write side shut), then
  what the client sends is read and dropped until it stops: its EOF, `LINGER_QUIET_S`
  with no byte, `LINGER_TOTAL_S` in all or `LINGER_MAX_BYTES`, whichever comes first.

`server.max_connections` then bounds what costs: a connection that arrives with the
limit reached has the idle one that waited longest closed for it (or, with none idle,
the oldest still sending a request), so a few hundred sockets that never send a whole
request lock no one out and hold a bounded number of descriptors. Lingering connections
go first (they have their answer), then idle ones. Busy connections are never closed for
room; one request past `max_connections` busy ones gets 429.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, Final, cast

from aiohttp import StreamReader, web
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
LINGER: Final = "lingering"
CLOSED: Final = "closed"
# A client still sending a body sends on within a moment; one quiet for this long is
# done, or stalled.
LINGER_QUIET_S: Final = 2.0
# Bounds on what a lingering connection costs however its client sends: time, and
# bytes read for nothing (a body many times [server] max_line_bytes' default).
LINGER_TOTAL_S: Final = 5.0
LINGER_MAX_BYTES: Final = 64 << 20
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpConnection(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's handler, and tells the pool
    what it sees (bytes in, writes stalled, gone)."""

    __slots__ = ("_pool", "inner", "transport", "phase", "_timer", "_write_timer",
                 "_next_request", "close_after", "peer", "fresh", "payload",
                 "_linger_end", "_linger_last", "_linger_bytes")

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
        # No byte of a first request yet: its idle limit is first_request_timeout_s.
        self.fresh = True
        # The body of the request last begun: unread to its end, closing lingers.
        self.payload: StreamReader | None = None
        self._linger_end = 0.0
        self._linger_last = 0.0
        self._linger_bytes = 0

    # --- asyncio.Protocol, forwarded ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        # aiohttp's close goes through `closing`, which may linger first.
        self.inner.connection_made(cast(asyncio.Transport, _Closer(self.transport, self)))
        self._pool.opened(self)

    def data_received(self, data: bytes) -> None:
        if self.phase == IDLE:
            self.fresh = False
            self._pool.enter(self, HEAD)
        elif self.phase == BUSY:
            self._next_request = True
        elif self.phase == LINGER:
            self._discard(len(data))
            return
        self.inner.data_received(data)

    def eof_received(self) -> None:
        # None, as aiohttp's: the transport closes at the client's EOF (a lingering
        # one too: the client has sent all it will).
        if self.phase != LINGER:
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

    def closing(self) -> None:
        """aiohttp closes the connection: at once, or, its request's body not read to
        the end, lingering first (the reply is written before the FIN either way)."""
        transport = self.transport
        if transport is None or self.phase == LINGER:
            return
        payload = self.payload
        if transport.is_closing() or payload is None or payload.is_eof() \
                or not self._pool.enter_linger(self):
            transport.close()
            return
        now = self._pool.now()
        self._linger_end = now + LINGER_TOTAL_S
        self._linger_last = now
        transport.write_eof()  # once the reply is flushed
        transport.resume_reading()  # aiohttp's flow control may have paused it

    def linger_timer(self) -> None:
        """The lingering connection's timer: closed once quiet or out of time."""
        now = self._pool.now()
        due = min(self._linger_last + LINGER_QUIET_S, self._linger_end)
        if now < due:
            self.set_timer(self._pool.arm(due - now, self.linger_timer))
        else:
            self.end_linger()

    def end_linger(self) -> None:
        self._pool.forget(self)
        if self.transport is not None:
            self.transport.close()

    def _discard(self, size: int) -> None:
        self._linger_last = self._pool.now()
        self._linger_bytes += size
        if self._linger_bytes > LINGER_MAX_BYTES:
            log.debug("closing a lingering HTTP connection: its client sent more than "
                      "%d bytes after its answer", LINGER_MAX_BYTES)
            self.end_linger()

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
        self._first_s = config.openai.first_request_timeout_s
        self._header_s = config.openai.header_timeout_s
        self._body_s = config.openai.body_timeout_s
        self.write_s = config.openai.write_timeout_s
        self._loop = asyncio.get_running_loop()
        # Oldest first: who is closed when room is needed.
        self._lingering: OrderedDict[HttpConnection, None] = OrderedDict()
        self._idle: OrderedDict[HttpConnection, None] = OrderedDict()
        self._reading: OrderedDict[HttpConnection, None] = OrderedDict()
        self._busy: set[HttpConnection] = set()
        self._by_handler: dict[web.RequestHandler, HttpConnection] = {}
        self._stopping = False

    def factory(self, make_handler: Callable[[], web.RequestHandler]
                ) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for `loop.create_server`: aiohttp's, wrapped."""
        return lambda: HttpConnection(self, make_handler())

    def arm(self, delay: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        return self._loop.call_later(delay, callback)

    def now(self) -> float:
        return self._loop.time()

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
        self._drop(connection)
        connection.phase = phase
        timer = None
        if phase == IDLE:
            self._idle[connection] = None
            idle_s = self._first_s if connection.fresh else self._idle_s
            if idle_s:
                timer = self.arm(idle_s, lambda: self._expired(connection, IDLE))
        elif phase == HEAD:
            self._reading[connection] = None
            timer = self.arm(self._header_s, lambda: self._expired(connection, HEAD))
        elif phase == BODY:
            self._reading[connection] = None  # its own timeout is the body read's
        elif phase == LINGER:
            self._lingering[connection] = None
            timer = self.arm(LINGER_QUIET_S, connection.linger_timer)
        else:
            self._busy.add(connection)
        connection.set_timer(timer)

    def forget(self, connection: HttpConnection) -> None:
        """The connection is closing: out of every count, its timer off. Idempotent."""
        if connection.phase != CLOSED:
            self._drop(connection)
            connection.phase = CLOSED
            connection.set_timer(None)
        self._by_handler.pop(connection.inner, None)
        self.stats.http_current = len(self._by_handler)

    def enter_linger(self, connection: HttpConnection) -> bool:
        """Whether the connection may linger (not while the listener closes)."""
        if self._stopping or connection.phase == CLOSED:
            return False
        self.enter(connection, LINGER)
        return True

    def stop_lingering(self) -> None:
        """The listener closes: no connection lingers from now on."""
        self._stopping = True
        for connection in list(self._lingering):
            connection.end_linger()

    def of(self, request: web.BaseRequest) -> HttpConnection | None:
        return self._by_handler.get(request.protocol)

    def _drop(self, connection: HttpConnection) -> None:
        self._lingering.pop(connection, None)
        self._idle.pop(connection, None)
        self._reading.pop(connection, None)
        self._busy.discard(connection)

    def _expired(self, connection: HttpConnection, phase: str) -> None:
        if connection.phase != phase:
            return
        if phase == HEAD:
            reason = "header_timeout"
        else:
            reason = "first_request_timeout" if connection.fresh else "idle_timeout"
        log.debug("closing an HTTP connection: %s", reason)
        connection.close(reason, self.stats)

    def _make_room(self, arrived: HttpConnection) -> None:
        for waiting in (self._lingering, self._idle, self._reading):
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
        connection.payload = request.content
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
            connection.close_after = True  # the rest is dropped by the lingering close
            raise
        except (HttpProcessingError, web.RequestPayloadError) as exc:
            connection.close_after = True
            raise ApiError(400, f"the request's body cannot be read: {_one_line(exc)}", None,
                           "bad_request") from None


class _Closer:
    """The transport as aiohttp's handler sees it: the connection's own, but for
    `close`, which is the connection's to do (it may linger first)."""

    def __init__(self, transport: asyncio.Transport, connection: HttpConnection) -> None:
        self._transport = transport
        self._connection = connection

    def close(self) -> None:
        self._connection.closing()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._transport, name)
        setattr(self, name, value)  # the next look-up finds it without this call
        return value


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
