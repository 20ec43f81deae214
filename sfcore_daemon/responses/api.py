"""The Responses API's routes: `POST /v1/responses`, and `GET` / `DELETE
/v1/responses/{id}` for the responses kept.

A request goes the way every HTTP API's does (decoded, translated into the core's
request, admitted and generated through the listener's `ApiHost`); what is its own is
the conversation: `previous_response_id` names a kept response, whose messages come
before the request's input, so a client sends only a turn's new items. The prompt
those messages render to starts with the last turn's, and the prompt store and the
slots hold that prefix's state: the turn starts warm.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from aiohttp import web

from sfcore_daemon.core.request import Message
from sfcore_daemon.httpd.api import ApiHost, HostedApi
from sfcore_daemon.httpd.errors import ApiError, json_response
from sfcore_daemon.responses.reply import ResponsesShape
from sfcore_daemon.responses.schema import DeletedResponse, responses_decoder
from sfcore_daemon.responses.store import ResponseStore, not_found
from sfcore_daemon.responses.translate import responses_request

API = "responses"


class ResponsesApi(HostedApi):
    """An `httpd.api.HttpApi`: the Responses handlers and the responses kept."""

    def __init__(self) -> None:
        super().__init__()
        self._store: ResponseStore | None = None

    def counted_ops(self) -> Iterable[tuple[str, str]]:
        return (("chat", API),)

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None:
        self.bind(host)
        config = host.state.config.openai
        self._store = ResponseStore(config.stored_responses, config.stored_responses_mb << 20)
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.get)
        router.add_delete("/v1/responses/{response_id}", self.delete)

    @property
    def store(self) -> ResponseStore:
        assert self._store is not None, "add_routes first"
        return self._store

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, responses_decoder)
        host.count("chat", API)
        try:
            history: list[Message] = []
            if body.previous_response_id is not None:
                stored = self.store.get(body.previous_response_id)
                if stored is None:
                    raise not_found(body.previous_response_id, "previous_response_id")
                history = stored.conversation
            shape = ResponsesShape(host.model_id, body,
                                   self.store.put if body.store else None)
            mapped = responses_request(body, shape.id, history)
        except ApiError:
            host.refuse_invalid()
            raise
        shape.conversation = mapped.conversation
        shape.history_length = len(history)
        return await host.generate(request, mapped.request, shape, arrived_ns)

    async def get(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return json_response(stored.body)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return json_response(DeletedResponse(id=response_id, object="response.deleted",
                                             deleted=True))
