"""The responses kept for the next turn (`previous_response_id`), GET and input_items.

`ResponseStore` keeps what a stored response's next turn needs: its conversation (the
messages before it and its own output), its input items and its object for GET.
Bounded by count and bytes (`[openai] stored_responses`, `stored_responses_mb`), least
recently used out first.

With a folder (the prompt store's, `[cache] dir` + `/responses`) each response is
also a file (records.py), written off the event loop, so a daemon started again finds
the ids of the last one: the index is read at start-up (names and sizes only) and a
record is read, and checked, when a request first names it. The byte bound is then
the files' sizes (each file holds its conversation whole). Without a folder they are
in memory only, where a chain's responses share the messages before them, and the
bound counts each response's own bytes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from sfcore_daemon.core.request import Message
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.responses import records
from sfcore_daemon.responses.records import DamagedRecord, Record, RecordWriter
from sfcore_daemon.responses.schema import ResponseObject

log = logging.getLogger(__name__)


class StoredResponse(NamedTuple):
    body: bytes  # the response object's JSON
    # Every message up to and with this response's output, instructions aside.
    conversation: list[Message]
    # Its input items, the earlier turns' first (input_items).
    items: list[dict[str, Any]]

    def next_items(self) -> list[dict[str, Any]]:
        """The items a response that follows this one starts from: these, then this
        one's output."""
        output = msgspec.json.decode(self.body).get("output") or []
        return [*self.items, *output]


class _Entry(NamedTuple):
    stored: StoredResponse | None  # None: on disk, not read since the start
    nbytes: int


class ResponseStore:
    """Stored responses by id, least recently used first. Event loop only."""

    def __init__(self, max_count: int, max_bytes: int, folder: Path | None = None) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._writer: RecordWriter | None = None
        if folder is not None and max_count > 0:
            self._open(folder)

    def _open(self, folder: Path) -> None:
        try:
            folder.mkdir(mode=records.FOLDER_MODE, parents=True, exist_ok=True)
            found = records.scan(folder)
        except OSError as exc:
            log.warning("stored responses kept in memory only: %s unusable (%s)", folder,
                        exc.strerror or exc)
            return
        self._writer = RecordWriter(folder)
        for item in found:
            self._index[item.response_id] = _Entry(None, item.size)
            self.nbytes += item.size
        self._evict()
        log.info("stored responses in %s: %d found", folder, len(self._index))

    @property
    def folder(self) -> Path | None:
        return self._writer.folder if self._writer is not None else None

    @property
    def writer(self) -> RecordWriter | None:
        return self._writer

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._index

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._index.get(response_id)
        if entry is None:
            return None
        stored = entry.stored
        if stored is None:
            stored = await self._read(response_id)
            entry = self._index.get(response_id)
            if stored is None or entry is None:  # damaged, or removed meanwhile
                return None
            self._index[response_id] = entry._replace(stored=stored)
        self._index.move_to_end(response_id)
        if self._writer is not None:
            self._writer.touch(response_id)
        return stored

    async def _read(self, response_id: str) -> StoredResponse | None:
        assert self._writer is not None
        try:
            record = await asyncio.to_thread(records.read_record, self._writer.folder,
                                             response_id, self.max_bytes)
        except DamagedRecord as exc:
            log.warning("stored response %s dropped: its file %s", response_id, exc.reason)
            self.delete(response_id)
            return None
        if record is None:
            # Removed by hand: forget it (its file is gone already).
            self._forget(response_id)
            return None
        return StoredResponse(bytes(record.body), record.conversation, record.items)

    def put(self, body: ResponseObject, conversation: list[Message], own: int,
            items: list[dict[str, Any]], own_items: int) -> None:
        """Keep `body`; the last `own` messages of `conversation` and the last
        `own_items` of `items` are its own (the rest are shared with the response
        before it, and counted there when in memory only)."""
        if self.max_count == 0:
            return
        data = encoder.encode(body)
        stored = StoredResponse(data, conversation, items)
        file = b""
        if self._writer is not None:
            file = records.encode_record(Record(id=body.id, conversation=conversation,
                                                items=items, body=msgspec.Raw(data)))
            nbytes = len(file)
        else:
            # A slot per message and item, and the bytes of what is this response's alone.
            nbytes = (8 * (len(conversation) + len(items)) + len(data)
                      + len(encoder.encode(conversation[-own:] if own else []))
                      + len(encoder.encode(items[-own_items:] if own_items else [])))
        if nbytes > self.max_bytes:
            return
        self._forget(body.id)
        self._index[body.id] = _Entry(stored, nbytes)
        self.nbytes += nbytes
        if self._writer is not None:
            self._writer.write(body.id, file)
        self._evict()

    def _evict(self) -> None:
        while len(self._index) > self.max_count or self.nbytes > self.max_bytes:
            response_id = next(iter(self._index))
            self.delete(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget `response_id` and remove its file; whether it was kept."""
        if not self._forget(response_id):
            return False
        if self._writer is not None:
            self._writer.remove(response_id)
        return True

    def _forget(self, response_id: str) -> bool:
        entry = self._index.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True


def responses_folder(cache_folder: Path | None) -> Path | None:
    """Where stored responses are kept: beside the prompt store's states."""
    if cache_folder is None:
        return None
    return Path(os.path.expanduser(cache_folder)) / "responses"


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's answer for an id it does not have (unknown, evicted, deleted, not stored)."""
    if param == "previous_response_id":
        return ApiError(404, f"Previous response with id {response_id!r} not found.", param,
                        "previous_response_not_found")
    return ApiError(404, f"No response found with id {response_id!r}.", param, "not_found")
