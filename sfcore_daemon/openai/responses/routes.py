"""The Responses API's routes: `POST /v1/responses`, and `GET` / `DELETE
/v1/responses/{id}` for the responses kept.

A request goes the way a chat completion does (routes.py: decoded, mapped, admitted,
generated); what is its own is the conversation: `previous_response_id` names a kept
response, whose messages come before the request's input, so a client sends only a
turn's new items. The prompt those messages render to starts with the last turn's, and
the prompt store and the slots hold that prefix's state: the turn starts warm.
"""

from __future__ import annotations

import time

from aiohttp import web

from sfcore_daemon.openai.responses.reply import ResponsesShape
from sfcore_daemon.openai.responses.schema import DeletedResponse, responses_decoder
from sfcore_daemon.openai.responses.store import ResponseStore, not_found
from sfcore_daemon.openai.responses.translate import responses_request
from sfcore_daemon.openai.routes import Routes, json_response
from sfcore_daemon.openai.translate import ApiError
from sfcore_daemon.serve import protocol
from sfcore_daemon.serve.protocol import Message


class ResponsesRoutes:
    """The Responses handlers, beside the chat ones, and the responses kept."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes
        config = routes.state.config.openai
        self.store = ResponseStore(config.stored_responses, config.stored_responses_mb << 20)

    def add_to(self, app: web.Application) -> None:
        router = app.router
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.get)
        router.add_delete("/v1/responses/{response_id}", self.delete)

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        routes = self.routes
        body = await routes._decode(request, responses_decoder)
        routes._count("chat", "responses")
        try:
            history: list[Message] = []
            if body.previous_response_id is not None:
                stored = self.store.get(body.previous_response_id)
                if stored is None:
                    raise not_found(body.previous_response_id, "previous_response_id")
                history = stored.conversation
            shape = ResponsesShape(routes.model_id, body,
                                   self.store.put if body.store else None)
            mapped = responses_request(body, shape.id, history)
        except ApiError:
            routes.state.stats.errors[protocol.INVALID_REQUEST] += 1
            raise
        shape.conversation = mapped.conversation
        shape.history_length = len(history)
        return await routes._generate(request, mapped.request, shape, arrived_ns)

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
