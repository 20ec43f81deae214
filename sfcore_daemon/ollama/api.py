"""Ollama's native API: `/api/chat`, `/api/generate`, `/api/tags`, `/api/show`,
`/api/ps`, `/api/version`, and `/` (the probe Ollama's clients send).

A body is decoded (schema.py), translated into the core's request (translate.py) and
generated through the listener's `ApiHost`: the same admission, slots, queue and
prompt store as every other API. Replies are NDJSON lines or one body (reply.py);
errors on /api/ paths are Ollama's `{"error": "..."}`, the listener's own included.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final

from aiohttp import web

from sfcore_daemon.core.request import GenerationRequest
from sfcore_daemon.httpd.api import ApiHost, HostedApi
from sfcore_daemon.httpd.errors import JSON_TYPE, ApiError, encoder, json_response
from sfcore_daemon.ollama import models, translate
from sfcore_daemon.ollama.reply import (
    NDJSON_TYPE,
    ChatShape,
    GenerateShape,
    line,
    loaded,
    message,
)
from sfcore_daemon.ollama.schema import (
    ErrorBody,
    ModelList,
    Version,
    chat_decoder,
    generate_decoder,
    show_decoder,
)

if TYPE_CHECKING:
    from sfcore_daemon.engine.thread import Engine

PREFIX: Final = "/api/"
CHAT: Final = "ollama_chat"
GENERATE: Final = "ollama_generate"
# The Ollama release whose API this follows (tools, a JSON Schema as `format`, `think`
# accepted): clients that enable features by the server's version enable these.
OLLAMA_VERSION: Final = "0.9.0"


class OllamaApi(HostedApi):
    """An `httpd.api.HttpApi`: Ollama's routes, with its errors in its own shape."""

    def counted_ops(self) -> Iterable[tuple[str, str]]:
        # /api/generate is a chat through the template, or with raw: true a completion.
        return (("chat", CHAT), ("chat", GENERATE), ("generate", GENERATE))

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None:
        self.bind(host)
        router.add_get("/", self.running)
        router.add_get("/api/version", self.version)
        router.add_get("/api/tags", self.tags)
        router.add_get("/api/ps", self.ps)
        router.add_post("/api/show", self.show)
        router.add_post("/api/chat", self.chat)
        router.add_post("/api/generate", self.generate)

    def error_response(self, path: str, error: ApiError) -> web.Response | None:
        if not path.startswith(PREFIX):
            return None
        return json_response(ErrorBody(error=message(error)), error.status)

    async def running(self, _request: web.Request) -> web.Response:
        return web.Response(text="Ollama is running")

    async def version(self, _request: web.Request) -> web.Response:
        return json_response(Version(version=OLLAMA_VERSION))

    async def tags(self, _request: web.Request) -> web.Response:
        engine = await self._engine()
        return json_response(ModelList(models=[
            models.entry(engine, self.host.model_id, running=False)]))

    async def ps(self, _request: web.Request) -> web.Response:
        engine = await self._engine()
        return json_response(ModelList(models=[
            models.entry(engine, self.host.model_id, running=True)]))

    async def show(self, request: web.Request) -> web.Response:
        # Any name is the served model, as for chat and generate (docs/ollama.md).
        await self.host.decode(request, show_decoder)
        engine = await self._engine()
        template = self.host.state.chat_template
        return json_response(models.show(engine, template.label if template else None))

    async def _engine(self) -> Engine:
        await self.host.loaded()
        engine = self.host.state.engine
        assert engine is not None
        return engine

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, chat_decoder)
        host.count("chat", CHAT)
        shape = ChatShape(models.tagged(host.model_id))
        if not body.messages and body.model:
            return await self._loaded(shape.model, body.stream, chat=True)
        core_request = self._mapped(request,
                                    lambda: translate.chat_request(body, _request_id()))
        return await host.generate(request, core_request, shape, arrived_ns)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, generate_decoder)
        host.count("generate" if body.raw else "chat", GENERATE)
        shape = GenerateShape(models.tagged(host.model_id))
        if not body.prompt and body.model and not (body.suffix or body.images):
            return await self._loaded(shape.model, body.stream, chat=False)
        core_request = self._mapped(request,
                                    lambda: translate.generate_request(body, _request_id()))
        return await host.generate(request, core_request, shape, arrived_ns)

    def _mapped(self, request: web.Request,
                mapping: Callable[[], GenerationRequest]) -> GenerationRequest:
        """The body's request, with the priority its header asks for (the one way
        Ollama's requests ask for one)."""
        try:
            return self.host.with_priority(request, mapping())
        except ApiError:
            self.host.refuse_invalid()
            raise

    async def _loaded(self, model: str, stream: bool, *, chat: bool) -> web.Response:
        """An empty request: Ollama loads the model and answers done_reason "load"."""
        await self.host.loaded()
        body = loaded(model, chat)
        if stream:
            return web.Response(body=line(body), content_type=NDJSON_TYPE)
        return web.Response(body=encoder.encode(body), content_type=JSON_TYPE)


def _request_id() -> str:
    """The request's id in the daemon (its log lines)."""
    return "ollama-" + secrets.token_hex(12)
