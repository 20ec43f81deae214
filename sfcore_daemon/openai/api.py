"""OpenAI's Chat Completions and Completions: `/v1/chat/completions`,
`/v1/completions`, `/v1/models`.

A body is decoded (schema.py), translated into the core's request (translate.py) and
generated through the listener's `ApiHost`; the reply is written in OpenAI's chunks or
body (shapes.py). The listener's default error shape is OpenAI's, so these paths need
none of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from aiohttp import web

from sfcore_daemon.core.request import GenerationRequest
from sfcore_daemon.httpd.api import ApiHost, HostedApi
from sfcore_daemon.httpd.errors import ApiError, json_response
from sfcore_daemon.openai import schema, translate
from sfcore_daemon.openai.schema import ModelCard, ModelList
from sfcore_daemon.openai.shapes import ChatShape, CompletionShape


class OpenAIApi(HostedApi):
    """An `httpd.api.HttpApi`."""

    def counted_ops(self) -> Iterable[tuple[str, str]]:
        return (("chat", "chat_completions"), ("generate", "completions"))

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None:
        self.bind(host)
        router.add_get("/v1/models", self.models)
        router.add_get("/v1/models/{model:.+}", self.model)
        router.add_post("/v1/chat/completions", self.chat)
        router.add_post("/v1/completions", self.completions)

    async def models(self, _request: web.Request) -> web.Response:
        await self.host.loaded()
        return json_response(ModelList(data=[self._card()]))

    async def model(self, request: web.Request) -> web.Response:
        host = self.host
        await host.loaded()
        name = request.match_info["model"]
        if name != host.model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this daemon serves "
                           f"{host.model_id!r}", "model", "model_not_found")
        return json_response(self._card())

    def _card(self) -> ModelCard:
        engine = self.host.state.engine
        size = engine.context_size if engine is not None else None
        return ModelCard(id=self.host.model_id, created=self.host.created,
                         context_length=size.n_ctx if size else 0,
                         kv_bytes=size.kv_bytes if size else 0)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, schema.chat_decoder, translate.chat_request,
                                      ChatShape, "chat", api="chat_completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, schema.completion_decoder,
                                      translate.completion_request, CompletionShape,
                                      "generate", api="completions")

    async def _completion(self, request: web.Request, decoder: msgspec.json.Decoder[Any],
                          mapping: Callable[[Any, str], GenerationRequest],
                          shape_type: type[ChatShape | CompletionShape],
                          op: str, *, api: str) -> web.StreamResponse:
        """Decode, translate into the core's request (`op`), and generate."""
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, decoder)
        host.count(op, api)
        shape = shape_type(host.model_id, host.fingerprint(), _include_usage(body))
        try:
            core_request = host.with_priority(request, mapping(body, shape.id))
        except ApiError:
            host.refuse_invalid()
            raise
        return await host.generate(request, core_request, shape, arrived_ns)


def _include_usage(body: schema.SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage
