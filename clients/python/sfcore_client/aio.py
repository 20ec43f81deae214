"""The asyncio client: the same shape as `Client`, with coroutines and async streams.

The connection is an asyncio Protocol that splits incoming bytes into lines and files
each one with the call it belongs to as soon as it arrives (replies come in request
order), so no task has to read for another: a half-read stream never blocks a later
call, and a call's consumer awaits only when nothing is buffered for it.

Leaving a stream early (break, an exception, task cancellation, `aclose()`) writes
`cancel` for it at once; its remaining lines, its `done` and the `cancelled` reply are
then consumed as they arrive, and the connection stays usable. If they have not come
within CANCEL_DRAIN_S, the connection is closed, which also stops the generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import threading
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import Any, Generic, TypeVar

from ._common import (
    CANCEL_DRAIN_S,
    DEFAULT_TIMEOUT,
    GENERATION_OPS,
    Call,
    OutOfStep,
    QueuePosition,
    Result,
    SfcoreConnectionError,
    SfcoreError,
    SfcoreTimeoutError,
    chat_messages,
    generation_request,
    in_finalizer_context,
    new_id,
    queued_behind,
    resolve_socket_path,
    result_of,
    route,
    unreachable,
)

T = TypeVar("T")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _encode(request: Mapping[str, Any]) -> bytes:
    return json.dumps(request, ensure_ascii=False).encode() + b"\n"


class _Connection(asyncio.Protocol):
    """One socket: lines in, filed with the calls in flight (a FIFO); lines out."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.transport: asyncio.Transport | None = None
        self.calls: deque[Call] = deque()
        self.closed = False
        self.waiters: list[asyncio.Future[None]] = []
        self._partial: list[bytes] = []
        self._write_paused = False
        self.refusal: SfcoreError | None = None
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self._lost: asyncio.Future[None] = self.loop.create_future()

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        lines = data.split(b"\n")
        if len(lines) == 1:  # a long line: keep its pieces, join once at its end
            self._partial.append(data)
            return
        if self._partial:
            self._partial.append(lines[0])
            lines[0] = b"".join(self._partial)
            self._partial = []
        tail = lines.pop()
        if tail:
            self._partial.append(tail)
        calls = self.calls
        loads = json.loads
        try:
            if not calls:
                self._unsolicited(lines)
                return
            for line in lines:
                if route(calls, loads(line)):
                    self.shutdown(SfcoreConnectionError(
                        f"the daemon closed the connection ({self.path}) after an error"))
                    break
        except (ValueError, OutOfStep) as exc:
            self.shutdown(SfcoreConnectionError(
                f"the daemon on {self.path} sent an unexpected line ({exc}); "
                "closed the connection"))
        self._wake()

    def _unsolicited(self, lines: list[bytes]) -> None:
        """Lines with no request pending: the daemon refusing the connection (an error
        line, then it closes). Keep the error for whoever asks next."""
        try:
            reply = json.loads(lines[0])
            if reply.get("type") == "error":
                self.refusal = SfcoreError(str(reply.get("code")), str(reply.get("message")),
                                           reply)
        except (ValueError, AttributeError):
            pass
        self.shutdown(self.refusal or SfcoreConnectionError(
            f"the daemon on {self.path} sent a line with no request pending"))

    def eof_received(self) -> bool | None:
        self.shutdown(SfcoreConnectionError(
            f"lost the connection to the daemon on {self.path}: it closed the connection"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        reason = "it closed the connection" if exc is None else str(exc)
        self.shutdown(SfcoreConnectionError(
            f"lost the connection to the daemon on {self.path}: {reason}"))
        if not self._lost.done():
            self._lost.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake()

    # --- used by the client ---

    def _wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def send(self, call: Call, request: Mapping[str, Any]) -> None:
        """Queue `call` and write its line (synchronously: the FIFO matches the wire)."""
        assert self.transport is not None
        call.conn = self
        if self.closed:
            call.fail(SfcoreConnectionError(f"the connection to {self.path} was closed"))
            return
        self.calls.append(call)
        self.transport.write(_encode(request))

    def hung_up(self) -> bool:
        """Whether the socket has something the loop has not read yet (on an idle
        connection: the daemon closed it)."""
        sock = self.transport.get_extra_info("socket") if self.transport else None
        if sock is None:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    async def wait(self, seconds: float | None) -> None:
        """Until the next batch of lines arrives, the writer may go on, or the end.
        Nothing for `seconds` gives the connection up."""
        if self.closed:
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
        except TimeoutError:
            self.shutdown(SfcoreTimeoutError(
                f"no reply from the daemon on {self.path} within {seconds} s; "
                "closed the connection"))

    async def drain(self, seconds: float | None) -> None:
        while self._write_paused and not self.closed:
            await self.wait(seconds)

    def shutdown(self, error: SfcoreError) -> None:
        """Give the connection up: fail every call in flight and close the socket."""
        if self.closed:
            return
        self.closed = True
        for call in tuple(self.calls):
            call.fail(error)
        if self.transport is not None:
            if self.loop.is_closed():
                pass  # nothing can run there any more (close a client in its own loop)
            elif _running_loop() is self.loop:
                self.transport.abort()
            else:  # from another thread or loop
                self.loop.call_soon_threadsafe(self.transport.abort)
        self._wake()

    async def closed_wait(self, seconds: float | None) -> None:
        try:
            async with asyncio.timeout(seconds):
                await asyncio.shield(self._lost)
        except TimeoutError:
            pass

    def cancel_later(self, call: Call) -> Call:
        """Write `cancel` for `call`; if it has not ended within CANCEL_DRAIN_S, give
        the connection up (which stops the generation too). The `cancelled` reply is
        filed whenever it comes (behind other requests, it may come much later)."""
        request = {"op": "cancel", "id": new_id(), "target": call.id}
        cancel = Call(request["id"])
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # finalized outside the loop: just end the connection
            self.closed = True
            if self.transport is not None:
                with contextlib.suppress(RuntimeError):
                    self.transport.abort()
            return cancel
        self.send(cancel, request)

        def check() -> None:
            if call.done:
                return
            if queued_behind(call):  # its lines are not due yet: look again later
                loop.call_later(CANCEL_DRAIN_S, check)
            else:
                self.shutdown(SfcoreTimeoutError(
                    f"a cancelled request on {self.path} did not end within "
                    f"{CANCEL_DRAIN_S} s; closed the connection"))

        loop.call_later(CANCEL_DRAIN_S, check)
        return cancel


class AsyncClient:
    """The asyncio client: `Client`'s methods as coroutines; streams are async iterators.

    Tasks may share one AsyncClient: requests are written as they come and answered in
    order on the one connection.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._connect_lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; calls still in flight fail. The client stays usable.
        (Close it in the event loop that used it: a loop that has ended cannot.)"""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.shutdown(SfcoreConnectionError("the client was closed"))
            if conn.loop is asyncio.get_running_loop():
                await conn.closed_wait(self.timeout)

    async def health(self) -> dict[str, Any]:
        return await self._final({"op": "health", "id": new_id()})

    async def info(self) -> dict[str, Any]:
        return await self._final({"op": "info", "id": new_id()})

    async def stats(self) -> dict[str, Any]:
        return await self._final({"op": "stats", "id": new_id()})

    async def metrics(self) -> str:
        """The counters in Prometheus' text exposition format (what GET /metrics serves)."""
        text: str = (await self._final({"op": "metrics", "id": new_id()}))["text"]
        return text

    async def cache(self, *, clear: bool = False) -> dict[str, Any]:
        """The prompt store's states (most recently used first); `clear=True` forgets
        them all first, in RAM and on disk."""
        return await self._final({"op": "cache", "id": new_id(),
                                 "action": "clear" if clear else "list"})

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        reply = await self._final({"op": "tokenize", "id": new_id(), "text": text,
                                   "add_special": add_special})
        tokens: list[int] = reply["tokens"]
        return tokens

    async def detokenize(self, tokens: Sequence[int]) -> str:
        reply = await self._final({"op": "detokenize", "id": new_id(), "tokens": list(tokens)})
        text: str = reply["text"]
        return text

    async def cancel(self, target: str | int) -> bool:
        """Cancel a request sent earlier on this client's connection; True if it was pending."""
        reply = await self._final({"op": "cancel", "id": new_id(), "target": target})
        return bool(reply["found"])

    async def generate(self, prompt: str, **options: Any) -> Result:
        done = await self._final(generation_request("generate", "prompt", prompt, False,
                                                    options))
        return result_of(done, done["text"])

    async def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Result:
        done = await self._final(generation_request("chat", "messages",
                                                    chat_messages(messages), False, options))
        return result_of(done, done["text"])

    def stream_generate(self, prompt: str, *,
                        on_queued: Callable[[QueuePosition], object] | None = None,
                        **options: Any) -> AsyncStream[str]:
        """`on_queued(QueuePosition)`: called, from the iteration, each time the daemon
        reports the request's place in its wait queue (before the first piece)."""
        return AsyncStream(self, generation_request("generate", "prompt", prompt, True,
                                                    options), on_queued=on_queued)

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    on_queued: Callable[[QueuePosition], object] | None = None,
                    **options: Any) -> AsyncStream[str]:
        return AsyncStream(self, generation_request("chat", "messages",
                                                    chat_messages(messages), True, options),
                           on_queued=on_queued)

    def request(self, message: Mapping[str, Any]) -> AsyncStream[dict[str, Any]]:
        """Send one request object as it is (an `id` is added if it has none) and iterate
        its reply lines as dicts, the final one included (for generate and chat also any
        `queued` line); an error line raises SfcoreError."""
        request = dict(message)
        request.setdefault("id", new_id())
        return AsyncStream(self, request, raw=True)

    # --- plumbing ---

    async def _final(self, request: dict[str, Any]) -> dict[str, Any]:
        call = await self._start(request)
        while not call.done:
            await call.conn.wait(self.timeout)
        return call.outcome()

    async def _connection(self) -> _Connection:
        conn = self._conn
        loop = asyncio.get_running_loop()
        if conn is not None and not conn.closed:
            if conn.loop is loop:
                return conn
            # Opened under another event loop (an earlier asyncio.run): not usable here.
            conn.shutdown(SfcoreConnectionError("opened under another event loop"))
            self._conn = None
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            conn = self._conn
            if conn is None or conn.closed:
                path = self.socket_path
                try:
                    async with asyncio.timeout(self.timeout):
                        _, conn = await loop.create_unix_connection(
                            lambda: _Connection(path), path)
                except OSError as exc:
                    raise unreachable(path, exc) from None
                except TimeoutError:
                    raise SfcoreTimeoutError(
                        f"cannot connect to {path} within {self.timeout} s "
                        "(the sfcore-ai daemon may not be running)") from None
                self._conn = conn
        return conn

    async def _usable_connection(self) -> _Connection:
        conn = self._conn
        if (conn is not None and not conn.closed and conn.loop is asyncio.get_running_loop()
                and not conn.calls and conn.hung_up()):
            # Closed by the daemon while idle ([server] idle_timeout_s), and the event
            # loop has not seen it yet: start afresh rather than lose the request.
            conn.shutdown(SfcoreConnectionError("the daemon closed the idle connection"))
        conn = await self._connection()
        if conn.closed or (not conn.calls and conn.hung_up()):
            # A new connection the daemon spoke on before any request: a refusal such as
            # too_many_connections. Let the loop read it, then raise it.
            if not conn.closed:
                await conn.closed_wait(self.timeout)
            raise conn.refusal or SfcoreConnectionError(
                f"the daemon on {self.socket_path} closed the connection at once")
        return conn

    async def _start(self, request: Mapping[str, Any], raw: bool = False) -> Call:
        conn = await self._usable_connection()
        call = Call(request["id"], raw, request.get("op") in GENERATION_OPS)
        conn.send(call, request)
        await conn.drain(self.timeout)
        if call.error is not None:
            raise call.error
        return call


class AsyncStream(Generic[T]):
    """`async for piece in stream`; `result` once the generation has ended.

    Leaving early cancels the generation (see the module doc). Use `async with` or
    `await stream.aclose()` to also wait (bounded) for its cancelled `result`.
    `on_queued` is called with a QueuePosition, from the iteration, for each `queued` line
    (a request waiting for a slot); `queue_position` is the last one read.
    """

    def __init__(self, client: AsyncClient, request: dict[str, Any], raw: bool = False, *,
                 on_queued: Callable[[QueuePosition], object] | None = None) -> None:
        self._client = client
        self._request = request
        self._raw = raw
        self._on_queued = on_queued
        self.id: str | int = request["id"]
        self._result: Result | None = None
        self._call: Call | None = None
        self._closed = False
        self._cancel: Call | None = None

    def __aiter__(self) -> AsyncIterator[T]:
        return _Iteration(self, self._run())

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def _run(self) -> AsyncGenerator[T, None]:
        client = self._client
        call = self._call
        if call is None:
            if self._closed:
                return
            conn = await client._usable_connection()
            generation = self._request.get("op") in GENERATION_OPS
            call = self._call = Call(self._request["id"], self._raw, generation,
                                     watch=generation and self._request.get("stream") is True)
            conn.send(call, self._request)
        conn = call.conn
        pieces = call.pieces
        timeout = client.timeout
        try:
            await conn.drain(timeout)
            if self._closed:  # cancel() came while the request was being sent
                self._send_cancel(call)
            on_queued = self._on_queued
            while True:
                while pieces:
                    piece = pieces.popleft()
                    if piece.__class__ is QueuePosition:
                        if on_queued is not None:
                            on_queued(piece)
                        continue
                    yield piece
                if call.done:
                    break
                await conn.wait(timeout)
        finally:
            if not call.done:  # left early: no awaiting here (this may be a finalizer)
                self._abandon(call)
        self._raise_error(call)

    @property
    def queue_position(self) -> QueuePosition | None:
        """The last place in the daemon's wait queue reported for this request (a
        `queued` line), or None: it never waited, or the daemon does not report it."""
        call = self._call
        return None if call is None else call.queued

    @property
    def result(self) -> Result | None:
        """The Result once the generation has ended (its `done` line was read), else None."""
        call = self._call
        if self._result is None and call is not None:
            final = call.final
            if final is not None and final["type"] == "done":
                self._result = result_of(final, final["text"] or "".join(call.parts),
                                         call.entries)
        return self._result

    @staticmethod
    def _raise_error(call: Call) -> None:
        if call.error is not None:
            raise call.error

    def _send_cancel(self, call: Call) -> None:
        conn: _Connection = call.conn
        if self._cancel is None and not call.done and not conn.closed:
            self._cancel = conn.cancel_later(call)

    def _abandon(self, call: Call) -> None:
        call.abandoned = True
        call.pieces.clear()
        self._send_cancel(call)

    def _dropped(self) -> None:
        """The caller's iteration object is gone (left the loop): cancel at once, so the
        cancel goes out before any later request of this client. From a garbage
        collection or another thread, only schedule it on the loop."""
        call = self._call
        if call is None or call.done or call.abandoned:
            return
        conn: _Connection = call.conn
        if conn.loop_thread == threading.get_ident() and not in_finalizer_context():
            self._abandon(call)
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to do
                conn.loop.call_soon_threadsafe(self._abandon_unless_done, call)

    def _abandon_unless_done(self, call: Call) -> None:
        if not call.done and not call.abandoned:
            self._abandon(call)

    async def cancel(self) -> None:
        """Ask the daemon to stop this generation; iteration then ends with the pieces
        already on their way and `result.finish_reason` "cancelled". Returns at once.
        Before iteration started, the request is simply never sent."""
        call = self._call
        if call is None:
            self._closed = True
        else:
            self._send_cancel(call)

    async def aclose(self) -> None:
        """Stop here: cancel the generation if it still runs, and wait (at most
        CANCEL_DRAIN_S) for its `done`, so that `result` is set. Behind another request
        on the shared connection its `done` comes only after that one's: then this
        returns at once, and the `done` is filed when it comes."""
        call = self._call
        if call is None:
            self._closed = True
            return
        if not call.done:
            self._abandon(call)
        conn: _Connection = call.conn
        try:
            async with asyncio.timeout(CANCEL_DRAIN_S):
                while not call.done and not queued_behind(call):
                    await conn.wait(None)
        except TimeoutError:
            conn.shutdown(SfcoreTimeoutError(
                f"a cancelled request on {conn.path} did not end in time; "
                "closed the connection"))
        call.pieces.clear()


class _Iteration(Generic[T]):
    """What `async for` holds: the stream's async generator, plus a finalizer that
    cancels at once when the loop is left (an async generator's own cleanup runs
    later, in a task the event loop schedules)."""

    __slots__ = ("_stream", "_agen")

    def __init__(self, stream: AsyncStream[T], agen: AsyncGenerator[T, None]) -> None:
        self._stream = stream
        self._agen = agen

    def __aiter__(self) -> _Iteration[T]:
        return self

    def __anext__(self) -> Awaitable[T]:
        return self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stream._dropped()


__all__ = ["AsyncClient", "AsyncStream"]
