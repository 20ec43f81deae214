"""The Messages routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

They run on the OpenAI listener's `Routes` (its body decoding, counting and
generation: one `Admission.admit`, the same slots, queue, prompt store and limits),
passed in as `Host` so that this package never imports the module that registers it.
Errors raised here are `ApiError`s; the listener writes them in Anthropic's shape on
these paths (errors.py).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import msgspec
from aiohttp import web

from sfcore_daemon.openai.messages import translate
from sfcore_daemon.openai.messages.errors import PREFIX
from sfcore_daemon.openai.messages.reply import MessagesReply, MessagesShape
from sfcore_daemon.openai.messages.schema import (
    TokensCount,
    count_tokens_decoder,
    encoder,
    messages_decoder,
)
from sfcore_daemon.openai.reply import HttpReply, ReplyShape
from sfcore_daemon.openai.translate import ApiError
from sfcore_daemon.serve import protocol
from sfcore_daemon.serve.admission import Admission, Refused
from sfcore_daemon.serve.protocol import ChatRequest, GenerationRequest
from sfcore_daemon.serve.state import ServerState

API = "messages"


class Host(Protocol):
    """What these routes use of the listener's `openai.routes.Routes`."""

    state: ServerState
    admission: Admission

    @property
    def model_id(self) -> str: ...

    async def _loaded(self) -> None: ...

    async def _decode(self, request: web.Request,
                      decoder: msgspec.json.Decoder[Any]) -> Any: ...

    def _count(self, op: str, api: str) -> None: ...

    async def _generate(self, request: web.Request, daemon_request: GenerationRequest,
                        shape: ReplyShape, arrived_ns: int,
                        reply_type: type[HttpReply] = HttpReply) -> web.StreamResponse: ...


def add_to(router: web.UrlDispatcher, host: Host) -> None:
    routes = MessagesRoutes(host)
    router.add_post(PREFIX, routes.messages)
    router.add_post(PREFIX + "/count_tokens", routes.count_tokens)


class MessagesRoutes:
    def __init__(self, host: Host) -> None:
        self.host = host

    async def messages(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host._decode(request, messages_decoder)
        host._count("chat", API)
        shape = MessagesShape(host.model_id)
        daemon_request = self._mapped(body, shape.id)
        try:
            return await host._generate(request, daemon_request, shape, arrived_ns,
                                        reply_type=MessagesReply)
        except ApiError as error:
            raise translate.in_messages_terms(error) from None

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """The prompt's tokens as /v1/messages would render and tokenize the same body
        (its template, its tools): equal to that reply's usage.input_tokens."""
        host = self.host
        body = await host._decode(request, count_tokens_decoder)
        host._count("tokenize", API)
        daemon_request = self._mapped(body, translate.message_id())
        await host._loaded()
        try:
            count = await host.admission.prompt_tokens(daemon_request)
        except Refused as refusal:
            host.state.stats.errors[refusal.code] += 1
            raise translate.in_messages_terms(
                ApiError.from_code(refusal.code, refusal.message)) from None
        return web.Response(body=encoder.encode(TokensCount(input_tokens=count)),
                            content_type="application/json")

    def _mapped(self, body: Any, request_id: str) -> ChatRequest:
        try:
            return translate.chat_request(body, request_id)
        except ApiError:
            self.host.state.stats.errors[protocol.INVALID_REQUEST] += 1
            raise
