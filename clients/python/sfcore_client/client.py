"""The blocking client: one Unix socket connection, requests answered in order.

Design:
- Every request gets a client-side id and a `Call` in the connection's FIFO. Whoever
  needs a reply reads lines (under the connection's read lock) and files each one with
  the call at the head of the FIFO, so a half-read stream never confuses a later call:
  its pieces wait in its own buffer. No lock is held across a stream's `yield`.
- Lines are split from `recv` chunks by `bytes.split`, with no limit on a line's length.
- Leaving a stream early (break, an exception, `close()`, dropping it) sends `cancel`
  for it on the same connection and reads up to its `done` and the `cancelled` reply,
  within CANCEL_DRAIN_S; failing that, the connection is closed, which also stops the
  generation. During cyclic garbage collection and interpreter shutdown no I/O is done:
  the connection is shut down instead. The next call reconnects.
- A Client may be shared between threads (sends and reads are locked separately);
  one stream should be iterated by one thread at a time.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
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
_RECV_BYTES = 1 << 18

def _hung_up(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the daemon closed it (an idle
    timeout, a shutdown), possibly after a line of its own."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _encode(request: Mapping[str, Any]) -> bytes:
    return json.dumps(request, ensure_ascii=False).encode() + b"\n"


class _Conn:
    """One socket, its calls in flight, and the lines read but not yet filed."""

    __slots__ = ("sock", "calls", "turn", "reading", "closed", "doomed", "_partial")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls: deque[Call] = deque()
        # One thread reads at a time (`reading`); the others wait on `turn`, which is
        # notified after every chunk filed, and find their calls served.
        self.turn = threading.Condition(threading.Lock())
        self.reading = False
        self.closed = False
        self.doomed = False  # shut down from a finalizer; dropped at the next use
        self._partial: list[bytes] = []

    def try_to_read(self) -> bool:
        """Become the reader if nobody is, without blocking (for finalizers and the like)."""
        if not self.turn.acquire(blocking=False):
            return False
        try:
            if self.reading:
                return False
            self.reading = True
            return True
        finally:
            self.turn.release()

    def done_reading(self) -> None:
        with self.turn:
            self.reading = False
            self.turn.notify_all()

    def read_lines(self) -> list[bytes]:
        """The complete lines of the next chunk(s) read, without their newlines (at least
        one); EOFError at the end of the stream."""
        recv = self.sock.recv
        while True:
            chunk = recv(_RECV_BYTES)
            if not chunk:
                raise EOFError
            lines = chunk.split(b"\n")
            if len(lines) == 1:  # a long line: keep its pieces, join once at its end
                self._partial.append(chunk)
                continue
            if self._partial:
                self._partial.append(lines[0])
                lines[0] = b"".join(self._partial)
                self._partial = []
            tail = lines.pop()
            if tail:
                self._partial.append(tail)
            return lines


class Client:
    """A blocking client of the sfcore-ai daemon. Connects lazily, and again after a
    connection was given up.

    `socket_path`: the argument, else $SFCORE_SOCKET, else /tmp/sfcore-ai.sock.
    `timeout`: seconds to wait for the connection and for each reply line (None: forever).
    Generation options (max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
    seed, stop, cache_prompt, priority, ...; chat also tools, tool_choice,
    parallel_tool_calls) are keyword arguments; None leaves the daemon's default.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self._conn: _Conn | None = None
        self._send_lock = threading.Lock()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection; calls still in flight fail. The client stays usable."""
        conn = self._conn
        if conn is not None:
            self._drop(conn, SfcoreConnectionError("the client was closed"))

    # --- single-line ops ---

    def health(self) -> dict[str, Any]:
        return self._final({"op": "health", "id": new_id()})

    def info(self) -> dict[str, Any]:
        return self._final({"op": "info", "id": new_id()})

    def stats(self) -> dict[str, Any]:
        return self._final({"op": "stats", "id": new_id()})

    def metrics(self) -> str:
        """The counters in Prometheus' text exposition format (what GET /metrics serves)."""
        text: str = self._final({"op": "metrics", "id": new_id()})["text"]
        return text

    def cache(self, *, clear: bool = False) -> dict[str, Any]:
        """The prompt store's states (most recently used first); `clear=True` forgets
        them all first, in RAM and on disk."""
        return self._final({"op": "cache", "id": new_id(),
                                 "action": "clear" if clear else "list"})

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        reply = self._final({"op": "tokenize", "id": new_id(), "text": text,
                             "add_special": add_special})
        tokens: list[int] = reply["tokens"]
        return tokens

    def detokenize(self, tokens: Sequence[int]) -> str:
        text: str = self._final({"op": "detokenize", "id": new_id(),
                                 "tokens": list(tokens)})["text"]
        return text

    def cancel(self, target: str | int) -> bool:
        """Cancel a request sent earlier on this client's connection (e.g. `stream.id`).

        Returns whether it was still pending. A stream it cancels ends soon after, with
        finish_reason "cancelled" and the pieces that were already on their way.
        """
        return bool(self._final({"op": "cancel", "id": new_id(), "target": target})["found"])

    # --- generations ---

    def generate(self, prompt: str, **options: Any) -> Result:
        done = self._final(generation_request("generate", "prompt", prompt, False, options))
        return result_of(done, done["text"])

    def chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> Result:
        done = self._final(generation_request("chat", "messages", chat_messages(messages),
                                              False, options))
        return result_of(done, done["text"])

    def stream_generate(self, prompt: str, *,
                        on_queued: Callable[[QueuePosition], object] | None = None,
                        **options: Any) -> Stream[str]:
        """Iterate for text pieces as they are generated; `.result` once it has ended.
        `on_queued(QueuePosition)` is called, from the iteration, each time the daemon
        reports the request's place in its wait queue (before the first piece)."""
        return Stream(self, generation_request("generate", "prompt", prompt, True, options),
                      on_queued=on_queued)

    def stream_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    on_queued: Callable[[QueuePosition], object] | None = None,
                    **options: Any) -> Stream[str]:
        return Stream(self, generation_request("chat", "messages", chat_messages(messages),
                                               True, options), on_queued=on_queued)

    def request(self, message: Mapping[str, Any]) -> Stream[dict[str, Any]]:
        """Send one request object as it is (an `id` is added if it has none) and iterate
        its reply lines as dicts, the final one included (for generate and chat also any
        `queued` line). An error line raises SfcoreError (its `.reply` is the line)."""
        request = dict(message)
        request.setdefault("id", new_id())
        return Stream(self, request, raw=True)

    # --- plumbing ---

    def _final(self, request: dict[str, Any]) -> dict[str, Any]:
        call = self._start(request)
        while not call.done:
            self._wait(call)
        return call.outcome()

    def _connect(self) -> _Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise unreachable(self.socket_path, exc) from None
        conn = self._conn = _Conn(sock)
        return conn

    def _start(self, request: Mapping[str, Any], raw: bool = False) -> Call:
        """Send a request and register its call; it is answered after those before it."""
        data = _encode(request)
        generation = request.get("op") in GENERATION_OPS
        # A streamed generation's Stream takes the QueuePositions of `queued` lines too.
        watch = generation and request.get("stream") is True
        call = Call(request["id"], raw, generation, watch)
        with self._send_lock:
            conn = self._conn
            if conn is not None and (conn.doomed or conn.closed
                                     or (not conn.calls and _hung_up(conn.sock))):
                # Given up, or closed by the daemon while idle ([server] idle_timeout_s).
                self._drop(conn, SfcoreConnectionError("the connection was given up"))
                conn = None
            reused = conn is not None
            if conn is None:
                conn = self._connect()
            idle = not conn.calls
            self._send_on(conn, call, data)
            if reused and idle and isinstance(call.error, SfcoreConnectionError):
                # The daemon closed the idle connection just now, so it never read this
                # request: send it once more on a new connection.
                call = Call(request["id"], raw, generation, watch)
                self._send_on(self._connect(), call, data)
        if call.error is not None:
            raise call.error
        return call

    def _send_on(self, conn: _Conn, call: Call, data: bytes) -> None:
        """With the send lock held: queue `call` on `conn` and send its line."""
        call.conn = conn
        conn.calls.append(call)
        try:
            conn.sock.sendall(data)
        except OSError as exc:
            # The daemon closed the connection; it may have said why first (e.g.
            # too_many_connections): read that, so the call fails with the daemon's error.
            if len(conn.calls) == 1 and conn.try_to_read():
                try:
                    self._salvage(conn)
                finally:
                    conn.done_reading()
            self._drop(conn, SfcoreConnectionError(
                f"lost the connection to {self.socket_path}: {exc.strerror or exc}"))
        except BaseException:  # e.g. KeyboardInterrupt: maybe half a line went out
            self._drop(conn, SfcoreConnectionError("interrupted while sending a request"))
            raise

    @staticmethod
    def _salvage(conn: _Conn) -> None:
        """File whatever the daemon sent before it closed the connection (bounded)."""
        with contextlib.suppress(OSError, EOFError, ValueError, OutOfStep):
            conn.sock.settimeout(0.5)
            while conn.calls:
                for line in conn.read_lines():
                    route(conn.calls, json.loads(line))

    def _send_cancel(self, call: Call, lock_timeout: float = -1) -> Call | None:
        """Send `cancel` for `call` on its connection (not waiting for the reply).

        Returns the cancel's own call, or None when the lock could not be taken in time
        or the connection is gone."""
        conn = call.conn
        request = {"op": "cancel", "id": new_id(), "target": call.id}
        cancel = Call(request["id"])
        if not self._send_lock.acquire(timeout=lock_timeout):
            return None
        try:
            if conn.closed or call.done:
                return None
            self._send_on(conn, cancel, _encode(request))
        finally:
            self._send_lock.release()
        return cancel

    def _wait(self, call: Call, deadline: float | None = None) -> None:
        """Read and file reply lines until `call` has a piece for its caller or has ended.

        One thread reads at a time, a chunk per turn, and files every line of it; a
        thread whose turn it is not waits until its call is served or the reader's turn
        ends. Every failure ends the connection (failing its calls), never just this
        call: after a timeout or a broken line the connection is out of step."""
        conn: _Conn = call.conn
        turn = conn.turn
        while not call.done and not call.pieces:
            with turn:
                while conn.reading and not call.done and not call.pieces:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    turn.wait(remaining)
                if call.done or call.pieces:
                    return
                if conn.reading:  # the deadline passed while another thread read
                    timed_out = True
                else:
                    timed_out = False
                    conn.reading = True
            if timed_out:
                self._drop(conn, SfcoreTimeoutError(
                    f"no reply from the daemon on {self.socket_path} in time; "
                    "closed the connection"))
                return
            try:
                self._read_chunk(conn, deadline)
            finally:
                conn.done_reading()

    def _read_chunk(self, conn: _Conn, deadline: float | None) -> None:
        """As the reader: file every line of the next chunk (a stream then takes its
        buffered pieces without coming back here)."""
        try:
            if deadline is not None:
                conn.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            calls = conn.calls
            loads = json.loads
            for line in conn.read_lines():
                if route(calls, loads(line)):
                    self._drop(conn, SfcoreConnectionError(
                        f"the daemon closed the connection ({self.socket_path}) after an "
                        "error"))
                    break
        except TimeoutError:
            limit = "" if deadline is not None else f" within {self.timeout} s"
            self._drop(conn, SfcoreTimeoutError(
                f"no reply from the daemon on {self.socket_path}{limit}; closed the connection"))
        except (OSError, EOFError) as exc:
            if not conn.closed:
                reason = "it closed the connection" if isinstance(exc, EOFError) \
                    else (exc.strerror or str(exc))
                self._drop(conn, SfcoreConnectionError(
                    f"lost the connection to the daemon on {self.socket_path}: {reason}"))
        except (ValueError, OutOfStep) as exc:
            self._drop(conn, SfcoreConnectionError(
                f"the daemon on {self.socket_path} sent an unexpected line ({exc}); "
                "closed the connection"))
        except BaseException:  # e.g. KeyboardInterrupt mid-read: out of step now
            self._drop(conn, SfcoreConnectionError("interrupted while reading a reply"))
            raise
        finally:
            if deadline is not None and not conn.closed:
                conn.sock.settimeout(self.timeout)

    def _drop(self, conn: _Conn, error: SfcoreError) -> None:
        """Close `conn` and fail every call still in flight on it."""
        if conn.closed:
            return
        conn.closed = True
        if self._conn is conn:
            self._conn = None
        for call in tuple(conn.calls):
            call.fail(error)
        with contextlib.suppress(OSError):  # first: it wakes a thread blocked in recv
            conn.sock.shutdown(socket.SHUT_RDWR)
        conn.sock.close()

    def _abandon_without_io(self, conn: _Conn) -> None:
        """From a finalizer: end the connection (the daemon then stops its generation)
        without blocking, reading, or touching state another frame may be using."""
        if conn.closed:
            return
        if conn.try_to_read():
            try:
                self._drop(conn, SfcoreConnectionError(
                    "a stream was garbage-collected unfinished; closed the connection"))
            finally:
                conn.done_reading()
        else:  # someone is reading: it sees the end of the stream and drops the connection
            conn.doomed = True
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


class Stream(Generic[T]):
    """One streamed generation (or, from `Client.request`, any request's reply lines).

    Iterate it for text pieces; `result` is the Result once the generation has ended
    (also after leaving early, when the cancelled `done` could be read). `on_queued` is
    called with a QueuePosition, from the iteration, for each `queued` line (a request
    waiting for a slot); `queue_position` is the last one read.
    """

    def __init__(self, client: Client, request: dict[str, Any], raw: bool = False, *,
                 on_queued: Callable[[QueuePosition], object] | None = None) -> None:
        self._client = client
        self._request = request
        self._raw = raw
        self._on_queued = on_queued
        self.id: str | int = request["id"]
        self._result: Result | None = None
        self._call: Call | None = None
        self._closed = False
        self._cancel_sent = False
        self._cancel_deferred = False
        self._cancel: Call | None = None  # the cancel request's own call

    def __iter__(self) -> Iterator[T]:
        # A fresh generator each time, referenced only by the caller's loop: leaving the
        # loop finalizes it at once, which cancels the generation (see _leave).
        return self._run()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self) -> Generator[T, None, None]:
        client = self._client
        call = self._call
        if call is None:
            if self._closed:
                return
            call = self._call = client._start(self._request, self._raw)
        pieces = call.pieces
        wait = client._wait
        try:
            while True:
                while pieces:
                    piece = pieces.popleft()
                    if piece.__class__ is QueuePosition:
                        self._queued(piece)
                        continue
                    yield piece
                if call.done:
                    break
                if self._cancel_deferred:
                    self.cancel()
                wait(call)
        except GeneratorExit:
            self._leave()
            raise
        self._raise_error(call)

    def _queued(self, position: QueuePosition) -> None:
        on_queued = self._on_queued
        if on_queued is not None:
            try:
                on_queued(position)
            except BaseException:  # leaves the stream: stop the generation
                self._leave()
                raise

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

    def cancel(self) -> None:
        """Ask the daemon to stop this generation and return at once: iteration then ends
        with the pieces already on their way, and `result.finish_reason` "cancelled".
        Safe to call from another thread or a signal handler. Before iteration started,
        the request is simply never sent."""
        call = self._call
        if call is None:  # not sent yet (or being sent right now: then _run sends it)
            self._closed = self._cancel_deferred = True
            return
        if call.done or self._cancel_sent:
            return
        # A signal handler may interrupt this thread while it holds the send lock: then
        # the running iteration sends the cancel itself at its next step.
        cancel = self._client._send_cancel(call, lock_timeout=0.2)
        if cancel is None and not call.done:
            self._cancel_deferred = True
            return
        self._cancel = cancel
        self._cancel_sent = True
        self._cancel_deferred = False

    def close(self) -> None:
        """Stop here: cancel the generation if it is still running (see the class doc)."""
        self._leave()

    def _leave(self) -> None:
        call = self._call
        if call is None:
            # Not sent, or being sent right now by an iteration in another thread: that
            # iteration sends the cancel before its first wait (as after cancel()).
            self._closed = self._cancel_deferred = True
            return
        if not call.done:
            call.abandoned = True
            call.pieces.clear()
            client = self._client
            if in_finalizer_context():
                client._abandon_without_io(call.conn)
                return
            deadline = time.monotonic() + min(CANCEL_DRAIN_S, client.timeout or CANCEL_DRAIN_S)
            if not self._cancel_sent:
                self._cancel = client._send_cancel(call, lock_timeout=CANCEL_DRAIN_S)
                self._cancel_sent = True
            cancel = self._cancel
            # Behind another request its `done` comes after that one's: filed then.
            while not call.done and not queued_behind(call):
                client._wait(call, deadline)
            # The `cancelled` reply: read it too when it is next in line, to leave nothing
            # unread. (Behind another request it waits for whoever reads next.)
            conn = call.conn
            while cancel is not None and not cancel.done and conn.calls \
                    and conn.calls[0] is cancel:
                client._wait(cancel, deadline)
        call.pieces.clear()

    def __del__(self) -> None:
        # No I/O in a finalizer: end the connection if the generation still runs.
        call = self._call
        if call is not None and not call.done and not call.abandoned:
            call.abandoned = True
            with contextlib.suppress(Exception):  # at interpreter exit, for instance
                self._client._abandon_without_io(call.conn)


__all__ = ["Client", "Stream"]
