"""One HTTP request's reply: a generation's events as a stream or one body.

`HttpReply` is the `ReplySink` a generation writes into: streamed text is encoded at
once into `pending` (by the API's `ReplyShape`) and the route's task, woken by
`ready`, hands it to aiohttp, which holds it to the socket's pace. A client that
stops reading lets `pending` grow; past `server.max_output_buffer_bytes` its
generation is abandoned, as a stalled NDJSON client's is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.errors import ApiError

if TYPE_CHECKING:
    from sfcore_daemon.core.generation import Generation

SSE_TYPE = "text/event-stream"


def event(data: bytes) -> bytes:
    """One server-sent event of `data`."""
    return b"data: " + data + b"\n\n"


class ReplyShape(Protocol):
    """How one API writes a generation: its stream's chunks and its whole body."""

    # The stream's media type: server-sent events, or NDJSON (Ollama's).
    content_type: str

    def opening(self) -> bytes: ...

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None: ...

    def closing(self, done: Result) -> bytes: ...

    def failure(self, error: ApiError) -> bytes:
        """The stream's last events for a generation that failed once streaming."""
        ...

    def whole(self, done: Result) -> bytes: ...


class HttpReply:
    """The sink of one HTTP request's generation (`output.ReplySink`, and what
    admission needs of a client: `gone`, `attach`). Event loop only."""

    def __init__(self, shape: ReplyShape, stream: bool, limit_bytes: int,
                 on_stalled: Callable[[HttpReply], None]) -> None:
        self.shape = shape
        self.stream = stream
        self._limit_bytes = limit_bytes
        self._on_stalled = on_stalled
        # Encoded chunks not yet handed to aiohttp.
        self.pending = bytearray()
        self.ready = asyncio.Event()
        # Set by done, error or close: nothing more comes.
        self.ended = False
        self.outcome: Result | ApiError | None = None
        # The client hung up or stopped reading.
        self.gone = False
        self.generation: Generation | None = None
        # The request's connection: aborted when its client stops reading, which ends
        # a write stuck waiting for it to drain.
        self.transport: asyncio.Transport | None = None

    def attach(self, generation: Generation) -> None:
        self.generation = generation

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        self.shape.chunk(text, logprobs, self.pending)

    def queued(self, position: int, depth: int) -> None:
        """Not shown: a stream keeps its client waiting with comments (api.py)."""

    def flush(self) -> None:
        if len(self.pending) > self._limit_bytes and not self.gone:
            self.gone = True
            self.pending.clear()
            self._on_stalled(self)
            return
        if self.pending:
            self.ready.set()

    def done(self, reply: Result) -> None:
        self._end(reply)

    def error(self, code: str, message: str) -> None:
        self._end(ApiError.from_code(code, message))

    def close(self) -> None:
        self._end(None)

    def _end(self, outcome: Result | ApiError | None) -> None:
        if not self.ended:
            self.ended = True
            self.outcome = outcome
            self.ready.set()

    def take(self) -> bytes:
        """What is pending, and the stream's last events once the reply has ended."""
        data = bytes(self.pending)
        self.pending.clear()
        self.ready.clear()
        if self.ended and not self.gone:
            outcome = self.outcome
            if isinstance(outcome, Result):
                data += self.shape.closing(outcome)
            elif isinstance(outcome, ApiError):
                data += self.shape.failure(outcome)
        return data
