"""The one public interface between the HTTP listener and the APIs it serves.

An API is a front end of its own (a folder: its schema, its translation into the
core's request, its reply shape, its routes); it registers its routes through
`HttpApi.add_routes` and serves them with what `ApiHost` offers: the body decoded
under the listener's limits, the request counted, the core's request admitted and its
reply streamed at the client's pace. No API reaches into another.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from sfcore_daemon.core import errors
from sfcore_daemon.core.admission import Admission, Refused
from sfcore_daemon.core.generation import Generation
from sfcore_daemon.core.request import (
    PRIORITIES,
    GenerationOptions,
    GenerationRequest,
    Priority,
)
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.httpd.errors import JSON_TYPE, ApiError
from sfcore_daemon.httpd.reply import SSE_TYPE, HttpReply, ReplyShape

log = logging.getLogger(__name__)

_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Proxies (nginx) pass the events on as they come instead of buffering them.
    "X-Accel-Buffering": "no",
}
# The request header that asks for a priority on every API (docs/protocol.md,
# Scheduling); it wins over a body's own (OpenAI's service_tier).
PRIORITY_HEADER = "X-Sfcore-Priority"
# What a waiting stream is sent every [openai] keepalive_s: an SSE comment.
KEEPALIVE = b": keep-alive\n\n"
_Request = TypeVar("_Request", bound=GenerationOptions)


def tier_priority(service_tier: Any) -> Priority:
    """OpenAI's service_tier (Chat Completions, Completions, Responses) as the wait
    queue's class: "flex" (slower, cheaper processing) is background, else interactive."""
    return "background" if service_tier == "flex" else "interactive"


class HttpApi(Protocol):
    """One API on the listener: its routes, the (op, api) pairs it counts, and its
    error shape on the paths it owns."""

    def counted_ops(self) -> Iterable[tuple[str, str]]: ...

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None: ...

    def error_response(self, path: str, error: ApiError) -> web.Response | None:
        """The error in this API's shape if `path` is one of its own; else None."""
        ...


class HostedApi:
    """A base for an `HttpApi`: the host its routes were registered with (`bind`), and
    the listener's default error shape on its paths (an API with its own overrides it)."""

    def __init__(self) -> None:
        self._host: ApiHost | None = None

    def bind(self, host: ApiHost) -> None:
        self._host = host

    @property
    def host(self) -> ApiHost:
        assert self._host is not None, "bind (in add_routes) first"
        return self._host

    def error_response(self, path: str, error: ApiError) -> web.Response | None:
        return None


class ApiHost:
    """What every API's handlers use of the daemon; event loop only."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.admission = Admission(state)
        self.created = int(time.time())

    @property
    def model_id(self) -> str:
        """The configured id, else the model file's name without `.gguf` (an id with
        no spaces, as clients put it in URLs and configs)."""
        configured = self.state.config.openai.model_id
        engine = self.state.engine
        if configured or engine is None:
            return configured
        return os.path.basename(engine.info.path).removesuffix(".gguf")

    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: the `done` line's model_fingerprint (the model,
        build and kernels a reply's bytes depend on) once the model is loaded."""
        engine = self.state.engine
        if engine is None or not engine.reply_fingerprint:
            return "sfcore"
        return "sfcore-" + engine.reply_fingerprint.removeprefix("sha256:")

    async def loaded(self) -> None:
        """Wait for the model; a daemon that stopped first is a 503."""
        try:
            await self.state.loaded_engine()
        except Exception:
            raise ApiError.from_code(errors.SHUTTING_DOWN,
                                     "the daemon stopped before the model was loaded") from None

    async def decode(self, request: web.Request, decoder: msgspec.json.Decoder[Any]) -> Any:
        """The body as the API's typed Struct; a bad one is a 400 naming the field."""
        data = await request.read()
        try:
            return decoder.decode(data)
        except msgspec.ValidationError as exc:
            self.count_error(errors.INVALID_REQUEST)
            raise ApiError.invalid(str(exc)) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 in a string
            self.count_error(errors.BAD_JSON)
            raise ApiError(400, f"the body is not valid JSON: {exc}", None, "bad_json") from None

    def count(self, op: str, api: str) -> None:
        stats = self.state.stats
        stats.requests_total += 1
        stats.count_request(op, api)

    def count_error(self, code: str) -> None:
        stats = self.state.stats
        stats.requests_total += 1
        stats.errors[code] += 1

    def refuse_invalid(self) -> None:
        """A body that decoded but does not map to the core's request."""
        self.state.stats.errors[errors.INVALID_REQUEST] += 1

    @staticmethod
    def with_priority(request: web.Request, core_request: _Request) -> _Request:
        """`core_request` with the priority the PRIORITY_HEADER asks for, if sent; a
        value other than interactive or background is a 400 (in the API's shape),
        which the caller counts as a body that does not map (`refuse_invalid`)."""
        given = request.headers.get(PRIORITY_HEADER)
        if given is None:
            return core_request
        if given not in PRIORITIES:
            raise ApiError(400, f"{PRIORITY_HEADER} must be interactive or background, not "
                           f"{given[:64]!a}", None, errors.INVALID_REQUEST)
        priority: Priority = "background" if given == "background" else "interactive"
        return msgspec.structs.replace(core_request, priority=priority)

    async def generate(self, request: web.Request, core_request: GenerationRequest,
                       shape: ReplyShape, arrived_ns: int,
                       reply_type: type[HttpReply] = HttpReply) -> web.StreamResponse:
        """Admit the request and answer with its generation: streamed as the shape's
        events, or one body once it has ended."""
        state = self.state
        if state.draining:
            state.stats.errors[errors.SHUTTING_DOWN] += 1
            raise ApiError.from_code(errors.SHUTTING_DOWN, "the daemon is shutting down")
        reply = reply_type(shape, core_request.stream,
                           state.config.server.max_output_buffer_bytes, self._stalled)
        reply.transport = request.transport
        generation: Generation | None = None
        try:
            try:
                generation = await self.admission.admit(core_request, reply, arrived_ns)
            except Refused as refusal:
                state.stats.errors[refusal.code] += 1
                raise ApiError.from_code(refusal.code, refusal.message) from None
            if core_request.stream:
                return await self._stream(request, reply)
            while not reply.ended:
                reply.ready.clear()
                await reply.ready.wait()
        except (asyncio.CancelledError, ConnectionError):
            # aiohttp cancels the task of a client that hung up (or a write finds it gone).
            if generation is None:
                state.stats.by_outcome["cancelled"] += 1
            else:
                self._abandon(generation)
            raise
        outcome = reply.outcome
        if isinstance(outcome, ApiError):
            raise outcome
        if outcome is None:
            return hang_up(request)
        return web.Response(body=shape.whole(outcome), content_type=JSON_TYPE)

    async def _stream(self, request: web.Request, reply: HttpReply) -> web.StreamResponse:
        response = await self._keep_alive(request, reply)
        # Before the first byte an error can still be a status code of its own.
        if (response is None and reply.ended and not reply.pending
                and isinstance(reply.outcome, ApiError)):
            raise reply.outcome
        if reply.gone:
            return hang_up(request, response)
        if response is None:
            response = await self._start_stream(request, reply)
        await pump(reply, response.write)
        if reply.gone:
            return hang_up(request, response)
        await response.write_eof()
        return response

    async def _keep_alive(self, request: web.Request,
                          reply: HttpReply) -> web.StreamResponse | None:
        """Wait for the reply's first events. A server-sent stream still waiting after
        [openai] keepalive_s (queued, or its prompt being read) gets its headers and a
        comment, then another comment each keepalive_s: its response, if started."""
        every = self.state.config.openai.keepalive_s
        if every <= 0 or reply.shape.content_type != SSE_TYPE:
            await reply.ready.wait()
            return None
        response = None
        while not reply.ready.is_set():
            try:
                async with asyncio.timeout(every):
                    await reply.ready.wait()
            except TimeoutError:
                if reply.ready.is_set():
                    break
                if response is None:
                    response = await self._start_stream(request, reply)
                await response.write(KEEPALIVE)
        return response

    @staticmethod
    async def _start_stream(request: web.Request, reply: HttpReply) -> web.StreamResponse:
        response = web.StreamResponse(headers={**_SSE_HEADERS,
                                               "Content-Type": reply.shape.content_type})
        await response.prepare(request)
        return response

    def _stalled(self, reply: HttpReply) -> None:
        """The client left more than max_output_buffer_bytes unread: give up on it."""
        log.info("dropping an HTTP client: it stopped reading (unread output over "
                 "server.max_output_buffer_bytes)")
        if reply.generation is not None:
            self._abandon(reply.generation)
        reply.close()
        if reply.transport is not None:
            reply.transport.abort()

    def _abandon(self, generation: Generation) -> None:
        scheduler = self.state.scheduler
        if scheduler is not None and not generation.replied:
            scheduler.abandon(generation)


async def pump(reply: HttpReply, write: Callable[[bytes], Awaitable[None]]) -> None:
    """Write the stream's events as they come, its opening first and its closing last.
    `write` waits for a slow reader: the reply may end meanwhile, so whether it had
    ended is read before each take, and the loop stops only after a take that saw it."""
    data = reply.shape.opening()
    while True:
        ended = reply.ended
        data += reply.take()
        if data:
            await write(data)
            data = b""
        if ended:
            return
        await reply.ready.wait()


def hang_up(request: web.Request,
            response: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the connection without another byte (the client stopped reading); aiohttp
    then finds the transport closed and writes nothing."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    return response if response is not None else web.Response()
