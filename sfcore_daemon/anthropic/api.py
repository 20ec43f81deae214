"""The Messages routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

They run on the listener's `ApiHost` (its body decoding, counting and generation: one
`Admission.admit`, the same slots, queue, prompt store and limits). Errors raised here
are `ApiError`s, written in Anthropic's shape on these paths (errors.py), the
listener's own refusals included.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from sfcore_daemon.anthropic import translate
from sfcore_daemon.anthropic.errors import PREFIX, error_body, is_messages_path
from sfcore_daemon.anthropic.reply import MessagesReply, MessagesShape
from sfcore_daemon.anthropic.schema import (
    TokensCount,
    count_tokens_decoder,
    messages_decoder,
)
from sfcore_daemon.core.admission import Refused
from sfcore_daemon.core.request import ChatRequest
from sfcore_daemon.httpd.api import ApiHost, HostedApi
from sfcore_daemon.httpd.errors import ApiError, json_response

API = "messages"


class MessagesApi(HostedApi):
    """An `httpd.api.HttpApi`: Anthropic's Messages, with its errors in its own shape."""

    def counted_ops(self) -> Iterable[tuple[str, str]]:
        return (("chat", API), ("tokenize", API))

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None:
        self.bind(host)
        router.add_post(PREFIX, self.messages)
        router.add_post(PREFIX + "/count_tokens", self.count_tokens)

    def error_response(self, path: str, error: ApiError) -> web.Response | None:
        if not is_messages_path(path):
            return None
        return json_response(error_body(error), error.status)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, messages_decoder)
        host.count("chat", API)
        shape = MessagesShape(host.model_id)
        core_request = self._mapped(body, shape.id, request)
        try:
            return await host.generate(request, core_request, shape, arrived_ns,
                                       reply_type=MessagesReply)
        except ApiError as error:
            raise translate.in_messages_terms(error) from None

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """The prompt's tokens as /v1/messages would render and tokenize the same body
        (its template, its tools): equal to that reply's usage.input_tokens."""
        host = self.host
        body = await host.decode(request, count_tokens_decoder)
        host.count("tokenize", API)
        core_request = self._mapped(body, translate.message_id())
        await host.loaded()
        try:
            count = await host.admission.prompt_tokens(core_request)
        except Refused as refusal:
            host.state.stats.errors[refusal.code] += 1
            raise translate.in_messages_terms(
                ApiError.from_code(refusal.code, refusal.message)) from None
        return json_response(TokensCount(input_tokens=count))

    def _mapped(self, body: Any, request_id: str,
                request: web.Request | None = None) -> ChatRequest:
        """The body's chat; with the `request` to generate, its priority header's."""
        try:
            mapped = translate.chat_request(body, request_id)
            if request is None:
                return mapped
            return self.host.with_priority(request, mapped)
        except ApiError:
            self.host.refuse_invalid()
            raise
