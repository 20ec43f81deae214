"""The routes: each HTTP request decoded, mapped, and admitted like an NDJSON request.

A chat or completions request goes through `serve.admission.Admission`, the one way
into the scheduler, with an `HttpReply` as its sink; the route's task then writes what
the generation produces: server-sent events as they come (aiohttp holds them to the
client's pace), or one body at the end. A client that hangs up has its task cancelled
by aiohttp, and its generation is abandoned at the next token (counted `cancelled`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from sfcore_daemon.openai import schema, translate
from sfcore_daemon.openai.messages import routes as messages_routes
from sfcore_daemon.openai.reply import ChatShape, CompletionShape, HttpReply, ReplyShape
from sfcore_daemon.openai.schema import ModelCard, ModelList, encoder
from sfcore_daemon.openai.translate import ApiError
from sfcore_daemon.serve import protocol
from sfcore_daemon.serve.admission import Admission, Refused
from sfcore_daemon.serve.metrics import CONTENT_TYPE, exposition
from sfcore_daemon.serve.output import Generation
from sfcore_daemon.serve.protocol import GenerationRequest
from sfcore_daemon.serve.state import ServerState

log = logging.getLogger(__name__)

JSON_TYPE = "application/json"
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # Proxies (nginx) pass the events on as they come instead of buffering them.
    "X-Accel-Buffering": "no",
}


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=encoder.encode(body), status=status, content_type=JSON_TYPE)


class Routes:
    """The endpoint's handlers, over the daemon's shared state; event loop only."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.admission = Admission(state)
        self.created = int(time.time())

    def add_to(self, app: web.Application) -> None:
        router = app.router
        router.add_get("/health", self.health)
        router.add_get("/v1/health", self.health)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.model)
        router.add_post("/v1/chat/completions", self.chat)
        router.add_post("/v1/completions", self.completions)
        router.add_get("/metrics", self.metrics)
        messages_routes.add_to(router, self)

    # --- model and health ---

    @property
    def model_id(self) -> str:
        """The configured id, else the model file's name without `.gguf` (an id with
        no spaces, as clients put it in URLs and configs)."""
        configured = self.state.config.openai.model_id
        engine = self.state.engine
        if configured or engine is None:
            return configured
        return os.path.basename(engine.info.path).removesuffix(".gguf")

    async def health(self, _request: web.Request) -> web.Response:
        state, scheduler = self.state, self.state.scheduler
        status = state.status
        return json_response({
            "status": status,
            "model": self.model_id,
            "slots": state.config.server.slots,
            "slots_busy": scheduler.busy_slots if scheduler is not None else 0,
            "queue_depth": scheduler.queue_depth if scheduler is not None else 0,
        }, 200 if status == "ok" else 503)

    async def metrics(self, _request: web.Request) -> web.Response:
        """Prometheus' scrape (serve/metrics.py); needs the API key when one is set."""
        self._count("metrics", "http")
        return web.Response(body=exposition(self.state).encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def models(self, _request: web.Request) -> web.Response:
        await self._loaded()
        return json_response(ModelList(data=[self._card()]))

    async def model(self, request: web.Request) -> web.Response:
        await self._loaded()
        name = request.match_info["model"]
        if name != self.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this daemon serves "
                           f"{self.model_id!r}", "model", "model_not_found")
        return json_response(self._card())

    def _card(self) -> ModelCard:
        return ModelCard(id=self.model_id, created=self.created)

    async def _loaded(self) -> None:
        try:
            await self.state.loaded_engine()
        except Exception:
            raise ApiError.from_code(protocol.SHUTTING_DOWN,
                                     "the daemon stopped before the model was loaded") from None

    # --- generations ---

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, schema.chat_decoder, translate.chat_request,
                                      ChatShape, "chat", api="chat_completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, schema.completion_decoder,
                                      translate.completion_request, CompletionShape,
                                      "generate", api="completions")

    async def _completion(self, request: web.Request, decoder: msgspec.json.Decoder[Any],
                          mapping: Any, shape_type: type[ChatShape | CompletionShape],
                          op: str, *, api: str) -> web.StreamResponse:
        """Decode, map to the daemon's own request (`op`), and generate."""
        arrived_ns = time.perf_counter_ns()
        body = await self._decode(request, decoder)
        self._count(op, api)
        shape = shape_type(self.model_id, self._fingerprint(), _include_usage(body))
        try:
            daemon_request: GenerationRequest = mapping(body, shape.id)
        except ApiError:
            self.state.stats.errors[protocol.INVALID_REQUEST] += 1
            raise
        return await self._generate(request, daemon_request, shape, arrived_ns)

    def _count(self, op: str, api: str) -> None:
        stats = self.state.stats
        stats.requests_total += 1
        stats.count_request(op, api)

    async def _decode(self, request: web.Request, decoder: msgspec.json.Decoder[Any]) -> Any:
        data = await request.read()
        try:
            return decoder.decode(data)
        except msgspec.ValidationError as exc:
            self._count_error(protocol.INVALID_REQUEST)
            raise ApiError.invalid(str(exc)) from None
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 in a string
            self._count_error(protocol.BAD_JSON)
            raise ApiError(400, f"the body is not valid JSON: {exc}", None, "bad_json") from None

    def _count_error(self, code: str) -> None:
        stats = self.state.stats
        stats.requests_total += 1
        stats.errors[code] += 1

    def _fingerprint(self) -> str:
        engine = self.state.engine
        return f"sfcore-{engine.info.architecture}" if engine is not None else "sfcore"

    async def _generate(self, request: web.Request, daemon_request: GenerationRequest,
                        shape: ReplyShape, arrived_ns: int,
                        reply_type: type[HttpReply] = HttpReply) -> web.StreamResponse:
        state = self.state
        if state.draining:
            state.stats.errors[protocol.SHUTTING_DOWN] += 1
            raise ApiError.from_code(protocol.SHUTTING_DOWN, "the daemon is shutting down")
        reply = reply_type(shape, daemon_request.stream,
                           state.config.server.max_output_buffer_bytes, self._stalled)
        reply.transport = request.transport
        generation: Generation | None = None
        try:
            try:
                generation = await self.admission.admit(daemon_request, reply, arrived_ns)
            except Refused as refusal:
                state.stats.errors[refusal.code] += 1
                raise ApiError.from_code(refusal.code, refusal.message) from None
            if daemon_request.stream:
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
            return _hang_up(request)
        return web.Response(body=shape.whole(outcome), content_type=JSON_TYPE)

    async def _stream(self, request: web.Request, reply: HttpReply) -> web.StreamResponse:
        await reply.ready.wait()
        # Before the first byte an error can still be a status code of its own.
        if reply.ended and not reply.pending and isinstance(reply.outcome, ApiError):
            raise reply.outcome
        if reply.gone:
            return _hang_up(request)
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        await pump(reply, response.write)
        if reply.gone:
            return _hang_up(request, response)
        await response.write_eof()
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
    """Write the stream's events as they come, its opening first and its closing (the
    finish reason, usage, `[DONE]`) last. `write` waits for a slow reader: the reply may
    end meanwhile, so whether it had ended is read before each take, and the loop stops
    only after a take that saw the end."""
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


def _include_usage(body: schema.SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _hang_up(request: web.Request,
             response: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the connection without another byte (the client stopped reading); aiohttp
    then finds the transport closed and writes nothing."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    return response if response is not None else web.Response()
