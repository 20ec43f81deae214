"""One client connection: NDJSON framing, flow control, reply order, idle timeout.

A `Connection` reads request lines and answers each in full, in the order the requests
arrived, even when they are pipelined: each request gets a `ReplySlot` in the
connection's outbox, and only the slot at the head writes to the socket. What a
request means is its owner's business (`ops.Ops.handle`). The connection also keeps
which of its requests are generations still writing (its slots attach them), so that
its client leaving or a `cancel` can reach them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from sfcore_daemon.core import errors
from sfcore_daemon.core.request import RequestId
from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ndjson.protocol import (
    DoneReply,
    QueuedReply,
    Request,
    RequestError,
    TokenReply,
)

if TYPE_CHECKING:
    from sfcore_daemon.config import Config
    from sfcore_daemon.core.generation import Generation
    from sfcore_daemon.core.scheduler import Scheduler
    from sfcore_daemon.core.stats import Stats

log = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 64 * 1024


class ConnectionOwner(Protocol):
    """What a connection needs of the server that accepted it."""

    @property
    def config(self) -> Config: ...

    @property
    def stats(self) -> Stats: ...

    @property
    def scheduler(self) -> Scheduler | None: ...

    async def handle(self, connection: Connection, request: Request, arrived_ns: int) -> bool:
        """Answer one decoded request; False when the connection must close after it."""
        ...


def _peer_hung_up(sock: Any) -> bool:
    """After EOF: did the peer close entirely (POLLHUP), or only shut down its writing side?"""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(events & (select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


# --- per connection -----------------------------------------------------------------------


class ReplySlot:
    """The reply lines of one request; written through only while it heads the outbox."""

    __slots__ = ("_connection", "held", "complete", "generation")

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.held: list[bytes] = []
        self.complete = False
        # The generation writing here, forgotten by the connection once it is answered.
        self.generation: Generation | None = None

    @property
    def gone(self) -> bool:
        """The client has left: nothing written here will reach it."""
        return self._connection.gone

    def attach(self, generation: Generation) -> None:
        """`generation` writes here: the connection knows it until this slot closes."""
        self.generation = generation
        self._connection.generations.add(generation)

    def write(self, data: bytes | bytearray) -> None:
        connection = self._connection
        if connection.gone:
            return
        if connection.outbox[0] is self:
            connection.send(data)
        else:
            self.held.append(bytes(data))
            connection.held_bytes += len(data)
            connection.update_flow()

    def close(self) -> None:
        if not self.complete:
            self.complete = True
            if self.generation is not None:
                self._connection.generations.discard(self.generation)
            self._connection.advance()


class GenerationReply:
    """A generation's reply events as NDJSON lines in its slot (`output.ReplySink`):
    `queued` lines while a stream waits, `token` lines gathered and written a batch at
    a time, then `done` or `error`."""

    __slots__ = ("_slot", "_request_id", "_batch")

    def __init__(self, slot: ReplySlot, request_id: RequestId) -> None:
        self._slot = slot
        self._request_id = request_id
        self._batch = bytearray()

    @property
    def gone(self) -> bool:
        return self._slot.gone

    def attach(self, generation: Generation) -> None:
        self._slot.attach(generation)

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        protocol.encode_line_into(
            TokenReply(id=self._request_id, text=text, logprobs=logprobs), self._batch)

    def flush(self) -> None:
        if self._batch:
            # A new buffer each time: the transport may keep the one it was given.
            batch, self._batch = self._batch, bytearray()
            self._slot.write(batch)

    def queued(self, position: int, depth: int) -> None:
        self._slot.write(protocol.encode_line(
            QueuedReply(id=self._request_id, position=position, queue_depth=depth)))

    def done(self, result: Result) -> None:
        self._slot.write(protocol.encode_line(DoneReply(**msgspec.structs.asdict(result))))
        self._slot.close()

    def error(self, code: str, message: str) -> None:
        self._slot.write(protocol.error_line(self._request_id, code, message))
        self._slot.close()

    def close(self) -> None:
        self._slot.close()


class Connection:
    """One client. Reads request lines and answers each in full, in arrival order.

    Flow control: past `max_pending_requests` unanswered requests, or
    `max_output_buffer_bytes` of replies held behind an unfinished one, the
    connection is not read until that drops, so what a client pipelines can never
    make the daemon's memory grow without bound.
    """

    def __init__(self, server: ConnectionOwner, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        self.transport = writer.transport
        self.outbox: deque[ReplySlot] = deque()
        self.generations: set[Generation] = set()
        self.gone = False
        self.replies_done = asyncio.Event()
        self.replies_done.set()
        # Bytes of finished replies waiting behind the head of the outbox.
        self.held_bytes = 0
        self.may_read = asyncio.Event()
        self.may_read.set()
        # When data last arrived or the last request was answered (idle timeout).
        self.last_activity = time.monotonic()

    # --- output ---

    def unanswered(self, request_id: RequestId) -> list[Generation]:
        """This connection's generations with id `request_id` not yet answered."""
        return [generation for generation in self.generations
                if generation.request_id == request_id and not generation.replied]

    @property
    def generating(self) -> bool:
        """Whether a generation of this connection still writes its reply."""
        return bool(self.generations)

    def open_slot(self) -> ReplySlot:
        slot = ReplySlot(self)
        self.outbox.append(slot)
        self.replies_done.clear()
        self.update_flow()
        return slot

    def reply(self, line: bytes) -> None:
        slot = self.open_slot()
        slot.write(line)
        slot.close()

    def reply_error(self, request_id: RequestId | None, code: str, message: str,
                    slot: ReplySlot | None = None) -> None:
        """An error line, in `slot` if the request already has one."""
        self.server.stats.errors[code] += 1
        line = protocol.error_line(
            request_id if request_id is not None else protocol.assign_id(), code, message)
        if slot is None:
            self.reply(line)
        else:
            slot.write(line)
            slot.close()

    def send(self, data: bytes | bytearray) -> None:
        transport = self.transport
        if transport.is_closing():
            self.drop("connection closed")
            return
        # Checked before the write: what is still unread from earlier writes says the
        # client stopped reading; one large reply (a long tokenize) says nothing.
        if transport.get_write_buffer_size() > self.server.config.server.max_output_buffer_bytes:
            self.drop("client stopped reading (unread output over server.max_output_buffer_bytes)")
            return
        transport.write(data)

    def advance(self) -> None:
        outbox = self.outbox
        while outbox and outbox[0].complete:
            outbox.popleft()
            if outbox and not self.gone:
                head = outbox[0]
                # Held replies go out together (flow control already bounds them), so
                # a reading client is not mistaken for a stalled one by their size.
                held = b"".join(head.held)
                self.held_bytes -= len(held)
                head.held.clear()
                if held:
                    self.send(held)
        if not outbox:
            self.replies_done.set()
            self.last_activity = time.monotonic()
        self.update_flow()

    def update_flow(self) -> None:
        limits = self.server.config.server
        if self.gone or (len(self.outbox) < limits.max_pending_requests
                         and self.held_bytes <= limits.max_output_buffer_bytes):
            self.may_read.set()
        else:
            self.may_read.clear()

    def drop(self, reason: str) -> None:
        """Give up on this client: cancel its work and close without further output."""
        if self.gone:
            return
        self.gone = True
        log.info("dropping connection: %s", reason)
        scheduler = self.server.scheduler
        if scheduler is not None:  # generations exist only once the model is loaded
            for generation in list(self.generations):
                scheduler.abandon(generation)
        self.outbox.clear()
        self.held_bytes = 0
        self.replies_done.set()
        self.may_read.set()
        self.transport.abort()

    # --- input ---

    async def serve(self) -> None:
        """Split the byte stream into lines and answer them; returns when done with it."""
        limits = self.server.config.server
        max_line = limits.max_line_bytes
        buffer = bytearray()
        scanned = 0  # bytes of `buffer` known to hold no newline
        while not self.gone:
            newline = buffer.find(b"\n", scanned)
            if newline == -1 and len(buffer) <= max_line:
                scanned = len(buffer)
                chunk = await self._read_chunk()
                if chunk is None:
                    return
                if chunk:
                    buffer += chunk
                    continue
                # EOF: a last line without its newline still counts.
                if buffer and not await self._line(bytes(buffer)):
                    await self.close_after_replies()
                    return
                await self._after_eof()
                return
            if newline == -1 or newline > max_line:
                # Nothing after the cut is executed: the rest of the stream is unread.
                self.reply_error(None, errors.LINE_TOO_LONG,
                                 f"line longer than server.max_line_bytes ({max_line} bytes); "
                                 "closing the connection")
                await self.close_after_replies()
                return
            line = bytes(buffer[:newline + 1])
            del buffer[:newline + 1]
            scanned = 0
            if not await self._line(line):
                await self.close_after_replies()
                return

    async def _line(self, line: bytes) -> bool:
        if not self.may_read.is_set():
            await self.may_read.wait()
            if self.gone:
                return False
        return await self.handle_line(line, time.perf_counter_ns())

    async def _read_chunk(self) -> bytes | None:
        """The next bytes from the client (b"" at EOF), or None once the connection is
        closed: the client left, or it sent nothing for `idle_timeout_s` while no
        request of its was in flight."""
        idle_timeout = self.server.config.server.idle_timeout_s
        while not self.gone:
            if not self.may_read.is_set():
                await self.may_read.wait()
                continue
            wait = None
            if idle_timeout > 0:
                wait = idle_timeout
                if not self.outbox:
                    wait -= time.monotonic() - self.last_activity
                    if wait <= 0:
                        log.info("closing a connection idle for %.1f s (server.idle_timeout_s)",
                                 idle_timeout)
                        self.gone = True
                        self.transport.close()
                        return None
            try:
                async with asyncio.timeout(wait):
                    chunk = await self.reader.read(_READ_CHUNK_BYTES)
            except TimeoutError:
                continue  # re-check: a request may be in flight, or time may be up
            except (ConnectionError, OSError):
                self.drop("connection lost")
                return None
            self.last_activity = time.monotonic()
            return chunk
        return None

    async def handle_line(self, line: bytes, arrived_ns: int) -> bool:
        """Answer one line; False when the connection must close after its replies."""
        if not line.strip():
            return True
        server = self.server
        server.stats.requests_total += 1
        try:
            request = protocol.decode_request(line)
        except RequestError as exc:
            self.reply_error(exc.request_id, exc.code, exc.message)
            return True
        return await server.handle(self, request, arrived_ns)

    async def _after_eof(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is None or _peer_hung_up(sock):
            self.drop("client disconnected")
            return
        # Only the client's writing side is shut (`socat`, `nc -N`): answer, then close.
        await self.close_after_replies()

    async def close_after_replies(self) -> None:
        """Close once every accepted request is answered, or drop if the client leaves first."""
        if not self.replies_done.is_set():
            # shield: cancelling our wait must not cancel the protocol's own close future.
            closed: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.shield(_wait_closed(self.writer)))
            replied: asyncio.Future[Any] = asyncio.ensure_future(self.replies_done.wait())
            await asyncio.wait({closed, replied}, return_when=asyncio.FIRST_COMPLETED)
            replied.cancel()
            closed.cancel()
            if not self.replies_done.is_set():
                self.drop("client disconnected")
                return
        if not self.gone:
            self.gone = True
            self.transport.close()


async def _wait_closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):  # a reset peer is just a closed peer here
        await writer.wait_closed()
