"""The HTTP listener: its socket, its aiohttp server, the APIs on it, its shutdown.

The socket is bound at start-up beside the NDJSON one, before the model loads, so a
busy port ends start-up with one line. Once serving, `HttpListener` is one of the
server's front ends (`core.server.Frontend`): it stops accepting when the daemon
drains, and closes its connections after the generations have ended. The APIs it
serves are given to it (`api.HttpApi`); it serves `/health` and `/metrics` itself.

Why aiohttp: its server runs on the daemon's own (uv)loop, parses HTTP in C
(llhttp), holds streamed writes to the client's pace (`StreamResponse.write` waits
for the socket to drain), and cancels a handler whose client hung up; no
hand-written parser, no second process, nothing on the decode thread. What it does
not bound, a connection's time in each phase and the room left at max_connections,
guard.py adds around its protocol; who may use the listener is gate.py's.

The middlewares, outermost first: the pool's `track` (phase, reply counted),
`_ErrorShapes` (each API's error shape on its paths), the gate (peer uid, Host,
Origin), the body read (`read_body`, then busy), the API key.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from sfcore_daemon.config import Config, ListenAddress
from sfcore_daemon.core import errors
from sfcore_daemon.core.metrics import CONTENT_TYPE, exposition
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.httpd.api import ApiHost, HttpApi
from sfcore_daemon.httpd.errors import ApiError, json_response
from sfcore_daemon.httpd.gate import Gate
from sfcore_daemon.httpd.guard import ConnectionPool, ServerLog
from sfcore_daemon.system.socketfile import ListeningSocket, StartupError, listening_at

log = logging.getLogger(__name__)

# How long closing waits for a handler still writing after the drain (it has its
# generation's last bytes to send, or a client that stopped reading).
_CLOSE_GRACE_S = 5.0
_NEVER_S = 10.0 * 365 * 86400
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def open_http_socket(address: ListenAddress, socket_mode: int) -> ListeningSocket:
    """Bind the listener's socket; StartupError (one line for the user) if it can't."""
    if address.unix_path:
        return listening_at(address.unix_path, socket_mode)
    host = "127.0.0.1" if address.host == "localhost" else address.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, address.port), family=family, backlog=512)
    except OSError as exc:
        raise StartupError(f"openai.listen {address}: cannot listen there: "
                           f"{exc.strerror or exc}") from None
    return ListeningSocket(sock, str(address), None)


def url_of(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HttpListener:
    """The HTTP front ends' listener: created with its bound socket and its APIs,
    started once the event loop runs, stopped by the server's shutdown."""

    def __init__(self, config: Config, listening: ListeningSocket,
                 apis: Sequence[HttpApi]) -> None:
        self._config = config
        self._listening = listening
        self._apis = tuple(apis)
        self.url = url_of(listening.sock)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._pool: ConnectionPool | None = None

    def describe(self) -> str:
        return f"OpenAI API on {self.url}"

    async def start(self, state: ServerState) -> None:
        config = self._config
        host = ApiHost(state)
        pool = self._pool = ConnectionPool(config, state.stats)
        gate = Gate(config, self._listening.sock, pool)
        shaped = _ErrorShapes(self._apis)
        app = web.Application(
            client_max_size=config.server.max_line_bytes,
            middlewares=[pool.track, shaped.middleware, gate.check, pool.read_body,
                         *_auth(config.openai.api_key)],
        )
        app.on_response_prepare.append(gate.add_cors_headers)
        _add_own_routes(app.router, host)
        for api in self._apis:
            state.stats.count_ops(api.counted_ops())
            api.add_routes(app.router, host)
        idle_s = config.server.idle_timeout_s
        # aiohttp's own timer also runs before a first request: after both of the pool's.
        keepalive_s = max(idle_s, config.openai.first_request_timeout_s) + 1.0
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            shutdown_timeout=_CLOSE_GRACE_S, logger=ServerLog(state.stats),
            # A body is read whole before any handler (guard.py); one left unread is a
            # refused request's, dropped by the pool's lingering close, not aiohttp's.
            lingering_time=0,
            # The pool closes idle connections (and counts them); aiohttp's own timer
            # only after it, or never, as [server] idle_timeout_s = 0 says.
            keepalive_timeout=keepalive_s if idle_s else _NEVER_S)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        server.request_handler = _screen_expect(server.request_handler, state, shaped)
        # Not a SockSite: the pool wraps aiohttp's protocol factory.
        self._server = await asyncio.get_running_loop().create_server(
            pool.factory(server), sock=self._listening.sock, backlog=512)
        log.info("serving the OpenAI API on %s", self.url)
        openai = config.openai
        if not openai.api_key and openai.address is not None \
                and not openai.address.is_loopback:
            log.warning("the OpenAI API on %s has no api_key and answers anyone who reaches "
                        "it ([openai] allow_remote_without_key = true)", self.url)

    async def stop_accepting(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.stop_lingering()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        self._listening.sock.close()
        self._listening.remove()


def _add_own_routes(router: web.UrlDispatcher, host: ApiHost) -> None:
    """What the listener answers itself, whichever APIs it serves."""
    state = host.state

    async def health(_request: web.Request) -> web.Response:
        scheduler, status = state.scheduler, state.status
        return json_response({
            "status": status,
            "model": host.model_id,
            "slots": state.config.server.slots,
            "slots_busy": scheduler.busy_slots if scheduler is not None else 0,
            "queue_depth": scheduler.queue_depth if scheduler is not None else 0,
        }, 200 if status == "ok" else 503)

    async def metrics(_request: web.Request) -> web.Response:
        """Prometheus' scrape (core/metrics.py); needs the API key when one is set."""
        host.count("metrics", "http")
        return web.Response(body=exposition(state).encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    router.add_get("/health", health)
    router.add_get("/v1/health", health)
    router.add_get("/metrics", metrics)


class _ErrorShapes:
    """Every error in the shape of the API whose path it is (OpenAI's elsewhere): ours,
    aiohttp's (404, 405, 413), and bugs."""

    def __init__(self, apis: Sequence[HttpApi]) -> None:
        self._apis = apis

    def response(self, path: str, error: ApiError) -> web.Response:
        for api in self._apis:
            shaped = api.error_response(path, error)
            if shaped is not None:
                return shaped
        return json_response(error.body(), error.status)

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as api_error:
            failure = api_error
        except web.HTTPRequestEntityTooLarge:
            failure = ApiError.from_code(
                errors.LINE_TOO_LONG, "the body is larger than server.max_line_bytes allows")
        except web.HTTPException as http_error:
            if http_error.status < 400:
                raise
            # The path is the client's bytes (undecodable ones as surrogates): escaped.
            path = ascii(request.path)[1:-1]
            failure = ApiError(http_error.status,
                               f"{request.method} {path}: {http_error.reason}", None,
                               "not_found" if http_error.status == 404 else None)
        except ConnectionError:
            raise
        except Exception:
            log.exception("HTTP request %s %s failed", request.method, request.path)
            failure = ApiError.from_code(errors.INTERNAL,
                                         "unexpected error in the daemon; see its log")
        return self.response(request.path, failure)


def _screen_expect(handle: _RequestHandler, state: ServerState,
                   shaped: _ErrorShapes) -> _RequestHandler:
    """aiohttp answers an `Expect` header before any middleware runs, and words its 417
    with the header's text: undecodable bytes there (which it hands on as surrogates)
    made that a 500 with a traceback. So an expectation other than 100-continue is
    refused here first, 417 in OpenAI's shape; 100-continue is left to aiohttp."""

    async def screened(request: web.BaseRequest) -> web.StreamResponse:
        expect = request.headers.get("Expect")
        if expect is None or expect.lower() == "100-continue":
            return await handle(request)
        state.stats.http_response(417)
        error = ApiError(417, "Expect: only 100-continue is supported", None,
                         "expectation_failed")
        response = shaped.response(request.path, error)
        response.force_close()
        return response

    return screened


def _auth(api_key: str) -> list[Middleware]:
    """The API key check (none without a key): `Authorization: Bearer <key>`, or
    `x-api-key: <key>` as Anthropic's clients send it. /health answers anyone, as a
    probe must."""
    if not api_key:
        return []
    expected = f"Bearer {api_key}".encode()
    expected_key = api_key.encode()

    @web.middleware
    async def check_key(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path not in ("/health", "/v1/health"):
            # The headers' own bytes: aiohttp hands undecodable ones on as surrogates.
            headers = request.headers
            given = headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            given_key = headers.get("x-api-key", "").encode("utf-8", "surrogateescape")
            # Constant time: how much of a guess matched must not show in the timing
            # (both compared, whichever was sent).
            bearer_ok = hmac.compare_digest(given, expected)
            key_ok = hmac.compare_digest(given_key, expected_key)
            if not (bearer_ok or key_ok):
                raise ApiError(401, "a valid API key is needed: send Authorization: "
                               "Bearer <key> or x-api-key: <key> ([openai] api_key)", None,
                               "invalid_api_key", "invalid_request_error")
        return await handler(request)

    return [check_key]
