"""Background responses (`background: true`): answered at once as `queued`, generated
without a client waiting, polled with `GET /v1/responses/{id}`, cancelled with
`POST /v1/responses/{id}/cancel`.

A background response goes through the same admission, queue and slots as any request
(`ApiHost.generate`, whole, not streamed); while it runs, GET answers its object as
`in_progress`. It ends kept in the store (it must have `store`): `completed` or
`incomplete` as a response answered at once would be, `failed` with its error, or
`cancelled` if a cancel came first (its generation is abandoned, and its slot freed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

import msgspec
from aiohttp import web

from sfcore_daemon.core.request import GenerationRequest
from sfcore_daemon.httpd.api import ApiHost
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.responses.reply import ResponsesShape
from sfcore_daemon.responses.schema import ResponseErrorOut, ResponseObject
from sfcore_daemon.responses.store import ResponseStore, not_found

log = logging.getLogger(__name__)

_ENDED = ("completed", "incomplete", "failed", "cancelled")


class _Job(NamedTuple):
    shape: ResponsesShape
    task: asyncio.Task[None]
    # Keeps the response as it ended (failed or cancelled), with its conversation.
    keep: Callable[[ResponseObject], None]


class Backgrounds:
    """The background responses still running. Event loop only."""

    def __init__(self, host: ApiHost, store: ResponseStore) -> None:
        self._host = host
        self._store = store
        self._jobs: dict[str, _Job] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, request: web.Request, core_request: GenerationRequest,
              shape: ResponsesShape, arrived_ns: int,
              keep: Callable[[ResponseObject], None]) -> ResponseObject:
        """Run the generation on a task of its own; the response as it is now."""
        task = asyncio.get_running_loop().create_task(
            self._run(request, core_request, shape, arrived_ns), name=shape.id)
        self._jobs[shape.id] = _Job(shape, task, keep)
        return msgspec.structs.replace(shape.base, status="queued")

    async def _run(self, request: web.Request, core_request: GenerationRequest,
                   shape: ResponsesShape, arrived_ns: int) -> None:
        try:
            # The request's connection may be gone: a whole reply only reads it to hang
            # up on a client that left, which a background response never checks.
            await self._host.generate(request, core_request, shape, arrived_ns)
        except ApiError as error:
            job = self._jobs.get(shape.id)
            if job is not None:
                log.info("background response %s failed: %s", shape.id, error.message)
                job.keep(msgspec.structs.replace(
                    shape.base, status="failed",
                    error=ResponseErrorOut(code=error.code or "server_error",
                                           message=error.message)))
        except asyncio.CancelledError:
            pass  # cancelled: cancel() kept it
        finally:
            self._jobs.pop(shape.id, None)

    def body(self, response_id: str) -> bytes | None:
        """A running response's object, if `response_id` is one."""
        job = self._jobs.get(response_id)
        if job is None:
            return None
        return encoder.encode(msgspec.structs.replace(job.shape.base, status="in_progress"))

    async def cancel(self, response_id: str) -> bytes:
        """Cancel a running background response; the cancelled response's object.
        One that ended is answered as it is if cancelled, else a 400 as OpenAI's."""
        job = self._jobs.pop(response_id, None)
        if job is not None:
            cancelled = msgspec.structs.replace(job.shape.base, status="cancelled")
            job.keep(cancelled)
            # Abandons its generation (ApiHost.generate), which frees its slot.
            job.task.cancel()
            log.info("background response %s cancelled", response_id)
            return encoder.encode(cancelled)
        stored = await self._store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        kept = msgspec.json.decode(stored.body)
        if not kept.get("background"):
            raise ApiError(400, "Only responses created with background=true can be "
                           "cancelled.", None, "invalid_request")
        if kept.get("status") != "cancelled" and kept.get("status") in _ENDED:
            raise ApiError(400, f"Cannot cancel a response that is {kept.get('status')}.",
                           None, "invalid_request")
        return stored.body
