"""The responses kept for the next turn (`previous_response_id`) and for GET.

`ResponseStore` keeps what a stored response's next turn needs: its conversation (the
messages before it and its own output, shared with the responses before it, not
copied) and its object for GET. Bounded by count and bytes (`[openai]
stored_responses`, `stored_responses_mb`), least recently used out first; memory only,
so ids end with the daemon. The prompt's state itself lives in the prompt store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from sfcore_daemon.core.request import Message
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.responses.schema import ResponseObject


class StoredResponse(NamedTuple):
    body: ResponseObject
    # Every message up to and with this response's output, instructions aside.
    conversation: list[Message]
    nbytes: int


class ResponseStore:
    """Stored responses by id, least recently used first. Event loop only."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored

    def put(self, body: ResponseObject, conversation: list[Message], own: int) -> None:
        """Keep `body`; the last `own` messages of `conversation` are its own (the rest
        are shared with the response before it, and counted there)."""
        # A slot per message, and the bytes of what is this response's alone.
        nbytes = (8 * len(conversation) + len(encoder.encode(conversation[-own:] if own else []))
                  + len(encoder.encode(body)))
        if nbytes > self.max_bytes or self.max_count == 0:
            return
        self.delete(body.id)
        self._stored[body.id] = StoredResponse(body, conversation, nbytes)
        self.nbytes += nbytes
        while len(self._stored) > self.max_count or self.nbytes > self.max_bytes:
            _, evicted = self._stored.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def delete(self, response_id: str) -> bool:
        stored = self._stored.pop(response_id, None)
        if stored is None:
            return False
        self.nbytes -= stored.nbytes
        return True


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's answer for an id it does not have (unknown, evicted, deleted, not stored)."""
    if param == "previous_response_id":
        return ApiError(404, f"Previous response with id {response_id!r} not found.", param,
                        "previous_response_not_found")
    return ApiError(404, f"No response found with id {response_id!r}.", param, "not_found")
