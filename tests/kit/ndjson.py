"""The one NDJSON client of the tests and the benches (PROTOCOL.md on a Unix socket).

`Client` is one asyncio connection that works line by line: it sends dicts or raw bytes
(pipelined in one write, or queued without draining), reads one reply line at a time or
a whole reply up to its final line, and times a reply's lines for the benches (`timed`).
The blocking functions below it are the raw side the fault tests need: bytes in chunks
at a pace, read to the end however the daemon ends the stream, and one request timed
on its own connection (`exchange`, for threaded clients such as scripts/gpu/bench.py).

It is the kit's own and not clients/python's `sfcore_client`: that package is a product
the suite tests (tests/clients/), with its own routing of lines to calls, reconnects and
typed results, so a fault in it must not hide a fault of the daemon, and it has no way
(by design) to send malformed lines or read whatever comes. Standard library only
(msgspec decodes faster where it is installed), so that a bare machine with the
repository copied can import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Self

REPLY_TIMEOUT_S = 60.0
LINE_LIMIT = 1 << 24  # the longest reply line a Client reads (a big tokenize, logprobs)

# The single or last line of a reply: everything but a streamed `token` (PROTOCOL.md:
# `done`, `error`, or an op's own reply).
FINAL_TYPES = frozenset({"done", "error", "health", "info", "stats", "tokens", "text", "cancelled",
                         "cache", "metrics"})
ERROR_CODES = frozenset({"bad_json", "invalid_request", "context_overflow", "queue_full",
                         "line_too_long", "too_many_connections", "forbidden",
                         "shutting_down", "internal"})


def _json_decoder() -> Callable[[bytes], dict[str, Any]]:
    try:
        import msgspec
    except ImportError:
        return json.loads
    decode: Callable[[bytes], dict[str, Any]] = msgspec.json.Decoder(dict[str, Any]).decode
    return decode


_decode_line = _json_decoder()


@dataclass
class Timed:
    """One reply timed by time.perf_counter(): `started` just before the request was
    written, `arrivals` one a token line, `ended` at the final line, `text` the tokens'
    text and the final line's own, `final` the final line (`done`, `error`, an op's)."""

    started: float
    arrivals: list[float]
    ended: float
    text: str
    final: dict[str, Any]

    @property
    def tokens(self) -> int:
        return len(self.arrivals)

    @property
    def first(self) -> float:
        """The first token line's arrival; the final line's if no token line came (a
        lone token held back by the UTF-8/stop filter arrives with `done`)."""
        return self.arrivals[0] if self.arrivals else self.ended

    @property
    def last(self) -> float:
        return self.arrivals[-1] if self.arrivals else self.ended


class Client:
    """One NDJSON connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, path: str, timeout: float = REPLY_TIMEOUT_S) -> Self:
        """A new connection to the daemon on the socket `path`."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(path, limit=LINE_LIMIT), timeout)
        return cls(reader, writer)

    def write(self, *messages: dict[str, Any] | bytes) -> None:
        """Queue messages in one write without waiting for the socket to take them (a
        client that never drains: what a hostile or abandoning peer does)."""
        self.writer.write(b"".join(
            m if isinstance(m, bytes) else json.dumps(m).encode() + b"\n" for m in messages))

    async def send(self, *messages: dict[str, Any] | bytes) -> None:
        """Send messages in one write (so several requests arrive pipelined)."""
        self.write(*messages)
        await self.writer.drain()

    async def recv(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any] | None:
        """The next reply line, or None at EOF."""
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            return None
        assert line.endswith(b"\n"), line
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def reply(self, timeout: float = REPLY_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every line of the next request's reply (up to its final line)."""
        lines = []
        while True:
            line = await self.recv(timeout)
            assert line is not None, f"connection closed mid-reply after {lines}"
            lines.append(line)
            if line["type"] in FINAL_TYPES:
                return lines

    async def request(self, message: dict[str, Any] | bytes,
                      timeout: float = REPLY_TIMEOUT_S) -> list[dict[str, Any]]:
        await self.send(message)
        return await self.reply(timeout)

    async def final(self, message: dict[str, Any] | bytes,
                    timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        return (await self.request(message, timeout))[-1]

    async def start_streaming(self, *messages: dict[str, Any]) -> dict[str, Any]:
        """Send (pipelined) requests and return once the first has streamed a token:
        from then on the slot is known to be busy with it (`queued` lines before it,
        while it waited for a slot, are passed over)."""
        await self.send(*messages)
        first = await self.recv()
        while first is not None and first["type"] == "queued":
            first = await self.recv()
        assert first is not None and first["type"] == "token", first
        return first

    async def expect_eof(self, timeout: float = REPLY_TIMEOUT_S) -> None:
        rest = await asyncio.wait_for(self.reader.read(), timeout)
        assert rest == b"", rest

    async def timed(self, request: dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> Timed:
        """Send one request and read its reply, timing the arrival of every line. Lean,
        for the benches: it shares the CPUs with the daemon, and every microsecond it
        spends per token line is taken from llama.cpp's threads, so one timeout bounds
        the whole reply (not a wait_for per line) and msgspec decodes the lines."""
        started = time.perf_counter()
        self.writer.write(json.dumps(request).encode() + b"\n")
        arrivals: list[float] = []
        parts: list[str] = []
        readline, decode, clock = self.reader.readline, _decode_line, time.perf_counter
        async with asyncio.timeout(timeout):
            while True:
                line = await readline()
                now = clock()
                if not line:
                    raise ConnectionError(f"the daemon closed the connection after "
                                          f"{len(arrivals)} token lines")
                reply = decode(line)
                if reply["type"] == "queued":  # waiting for a slot: not a token
                    continue
                if reply["type"] != "token":
                    break
                arrivals.append(now)
                parts.append(reply["text"])
        return Timed(started, arrivals, now, "".join(parts) + reply.get("text", ""), reply)

    def abort(self) -> None:
        """Drop the connection at once (a reset, nothing flushed)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(self.writer.wait_closed(), REPLY_TIMEOUT_S)




def tokens_text(lines: list[dict[str, Any]]) -> str:
    return "".join(line["text"] for line in lines if line["type"] == "token")


def done_of(lines: list[dict[str, Any]]) -> dict[str, Any]:
    assert lines[-1]["type"] == "done", lines[-1]
    return lines[-1]


# --- blocking, raw sockets ------------------------------------------------------------------


@dataclass
class RawResult:
    data: bytes
    ended: str  # "eof", "reset" or "timeout": how the daemon's side of the stream ended
    send_error: str | None  # why sending stopped early (the daemon closed), if it did
    sent: int  # bytes accepted by the kernel

    def lines(self) -> list[dict[str, Any]]:
        return parse_reply_lines(self.data)


def parse_reply_lines(data: bytes) -> list[dict[str, Any]]:
    """Every reply line: one JSON object with `id` and `type`, each ended by a newline."""
    assert not data or data.endswith(b"\n"), f"partial last line: {data[-200:]!r}"
    replies = []
    for raw in data.splitlines():
        reply = json.loads(raw)
        assert isinstance(reply, dict), raw[:200]
        assert "id" in reply and "type" in reply, reply
        assert isinstance(reply["id"], str | int) and not isinstance(reply["id"], bool), reply
        replies.append(reply)
    return replies


def connect_raw(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def read_to_end(sock: socket.socket, limit: int = 1 << 30) -> tuple[bytes, str]:
    """Everything the peer sends until it closes. A reset (the daemon closed with our
    unread bytes in its buffer) still delivers what arrived before it."""
    received = bytearray()
    while len(received) < limit:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(received), "reset"
        except TimeoutError:
            return bytes(received), "timeout"
        if not chunk:
            return bytes(received), "eof"
        received += chunk
    return bytes(received), "limit"


def raw_exchange(path: str, chunks: Iterable[bytes], *, pace_s: float = 0.0,
                 half_close: bool = False, timeout: float = 60.0) -> RawResult:
    """Send `chunks` (blocking, one write each) while a thread reads until the daemon
    closes; returns what was read. Run it with asyncio.to_thread."""
    sock = connect_raw(path, timeout)
    result: dict[str, Any] = {}

    def receive() -> None:
        result["data"], result["ended"] = read_to_end(sock)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    send_error = None
    sent = 0
    try:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError) as exc:
                send_error = type(exc).__name__
                break
            except TimeoutError:
                send_error = "send timed out (the daemon stopped reading)"
                break
            sent += len(chunk)
            if pace_s:
                time.sleep(pace_s)
        if half_close and send_error is None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        receiver.join(timeout + 5)
        assert not receiver.is_alive(), "reader thread did not finish"
    finally:
        sock.close()
    return RawResult(result["data"], result["ended"], send_error, sent)


def exchange(path: str, request: dict[str, Any], timeout: float = REPLY_TIMEOUT_S) -> Timed:
    """One request on a connection of its own, blocking (for clients on threads): the
    reply timed as `Client.timed` times it. ConnectionError if the daemon closes first."""
    with connect_raw(path, timeout) as sock, sock.makefile("rb") as lines:
        started = time.perf_counter()
        sock.sendall(json.dumps(request).encode() + b"\n")
        arrivals: list[float] = []
        parts: list[str] = []
        for line in lines:
            now = time.perf_counter()
            reply = _decode_line(line)
            if reply["type"] == "queued":  # waiting for a slot: not a token
                continue
            if reply["type"] != "token":
                return Timed(started, arrivals, now, "".join(parts) + reply.get("text", ""),
                             reply)
            arrivals.append(now)
            parts.append(reply["text"])
    raise ConnectionError(f"the daemon on {path} closed the connection mid-reply")
