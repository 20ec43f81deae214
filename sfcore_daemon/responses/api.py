"""The Responses API's routes: `POST /v1/responses`; `GET` / `DELETE
/v1/responses/{id}` and `GET /v1/responses/{id}/input_items` for the responses kept;
`POST /v1/responses/{id}/cancel` for a background one (background.py).

A request goes the way every HTTP API's does (decoded, translated into the core's
request, admitted and generated through the listener's `ApiHost`); what is its own is
the conversation: `previous_response_id` names a kept response, whose messages come
before the request's input, so a client sends only a turn's new items. The prompt
those messages render to starts with the last turn's, and the prompt store and the
slots hold that prefix's state: the turn starts warm. Kept on disk beside the prompt
store's states (store.py), a conversation resumes after a restart as warm as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from sfcore_daemon.core import errors
from sfcore_daemon.core.request import Message
from sfcore_daemon.httpd.api import ApiHost, HostedApi
from sfcore_daemon.httpd.errors import JSON_TYPE, ApiError, json_response
from sfcore_daemon.responses.background import Backgrounds
from sfcore_daemon.responses.items import input_items, page
from sfcore_daemon.responses.reply import ResponsesShape
from sfcore_daemon.responses.schema import DeletedResponse, ResponseObject, responses_decoder
from sfcore_daemon.responses.store import (
    ResponseStore,
    StoredResponse,
    not_found,
    responses_folder,
)
from sfcore_daemon.responses.translate import responses_request
from sfcore_daemon.responses.truncate import fit
from sfcore_daemon.store.promptstore import cache_folder

API = "responses"


class ResponsesApi(HostedApi):
    """An `httpd.api.HttpApi`: the Responses handlers and the responses kept."""

    def __init__(self) -> None:
        super().__init__()
        self._store: ResponseStore | None = None
        self._backgrounds: Backgrounds | None = None

    def counted_ops(self) -> Iterable[tuple[str, str]]:
        return (("chat", API),)

    def add_routes(self, router: web.UrlDispatcher, host: ApiHost) -> None:
        self.bind(host)
        config = host.state.config
        cache = config.cache
        folder = responses_folder(cache_folder(cache) if cache.enabled else None)
        self._store = ResponseStore(config.openai.stored_responses,
                                    config.openai.stored_responses_mb << 20, folder)
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.get)
        router.add_delete("/v1/responses/{response_id}", self.delete)
        router.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        self._backgrounds = Backgrounds(host, self._store)

    @property
    def store(self) -> ResponseStore:
        assert self._store is not None, "add_routes first"
        return self._store

    @property
    def backgrounds(self) -> Backgrounds:
        assert self._backgrounds is not None, "add_routes first"
        return self._backgrounds

    async def create(self, request: web.Request) -> web.StreamResponse:
        arrived_ns = time.perf_counter_ns()
        host = self.host
        body = await host.decode(request, responses_decoder)
        host.count("chat", API)
        try:
            history: list[Message] = []
            items: list[dict[str, Any]] = []
            if body.previous_response_id is not None:
                stored = await self.store.get(body.previous_response_id)
                if stored is None:
                    raise not_found(body.previous_response_id, "previous_response_id")
                history = stored.conversation
                items = stored.next_items()
            own_items = input_items(body)
            items += own_items
            store = self.store

            def keep(response: ResponseObject, conversation: list[Message], own: int) -> None:
                store.put(response, conversation, own, items, len(own_items))

            def keep_ended(response: ResponseObject) -> None:
                keep(response, shape.conversation,
                     len(shape.conversation) - shape.history_length)

            if body.background and store.max_count == 0:
                raise ApiError(400, "background responses are polled from the stored ones, "
                               "and [openai] stored_responses is 0", "background")
            shape = ResponsesShape(host.model_id, body, keep if body.store else None)
            mapped = responses_request(body, shape.id, history)
            mapped = mapped._replace(request=host.with_priority(request, mapped.request))
        except ApiError:
            host.refuse_invalid()
            raise
        core_request, conversation, dropped = mapped.request, mapped.conversation, 0
        if body.truncation == "auto":
            core_request, conversation, dropped = await fit(
                host, mapped.request, mapped.conversation, body.max_output_tokens)
        # What the model read is what the next turn starts from.
        shape.conversation = conversation
        shape.history_length = max(0, len(history) - dropped)
        if body.background:
            if host.state.draining:
                raise ApiError.from_code(errors.SHUTTING_DOWN, "the daemon is shutting down")
            return json_response(self.backgrounds.start(request, core_request, shape,
                                                        arrived_ns, keep_ended))
        return await host.generate(request, core_request, shape, arrived_ns)

    async def _stored(self, request: web.Request) -> StoredResponse:
        response_id = request.match_info["response_id"]
        stored = await self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    async def get(self, request: web.Request) -> web.Response:
        running = self.backgrounds.body(request.match_info["response_id"])
        body = running if running is not None else (await self._stored(request)).body
        return web.Response(body=body, content_type=JSON_TYPE)

    async def cancel(self, request: web.Request) -> web.Response:
        body = await self.backgrounds.cancel(request.match_info["response_id"])
        return web.Response(body=body, content_type=JSON_TYPE)

    async def input_items(self, request: web.Request) -> web.Response:
        return json_response(page((await self._stored(request)).items, request.query))

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if self.backgrounds.body(response_id) is not None:
            await self.backgrounds.cancel(response_id)
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return json_response(DeletedResponse(id=response_id, object="response.deleted",
                                             deleted=True))
