"""The OpenAI endpoint's limits and shutdown, over raw HTTP/1.1 on a real daemon.

Raw sockets, because what is tested is what a client library hides: a client that stops
reading, one connection too many, a keep-alive connection that asks while the daemon
drains, a stream that goes on to its end after SIGTERM, and a body far over the limit
sent whole (or without end) before its 413 is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sfcore_daemon.httpd.guard import LINGER_MAX_BYTES, LINGER_QUIET_S, LINGER_TOTAL_S
from tests.kit import REPLY_TIMEOUT_S, Daemon, running_daemon
from tests.kit.http import LISTEN, port_of, request_bytes, wait_for_outcome

pytestmark = pytest.mark.asyncio


class RawHttp:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def head(self) -> tuple[int, dict[str, str]]:
        status_line = await asyncio.wait_for(self.reader.readline(), REPLY_TIMEOUT_S)
        assert status_line, "the connection closed before a status line"
        status = int(status_line.split()[1])
        headers = {}
        while (line := await asyncio.wait_for(self.reader.readline(), REPLY_TIMEOUT_S)) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def json_reply(self) -> tuple[int, dict[str, Any]]:
        status, headers = await self.head()
        length = int(headers["content-length"])
        body = await asyncio.wait_for(self.reader.readexactly(length), REPLY_TIMEOUT_S)
        return status, json.loads(body)

    async def events(self) -> AsyncIterator[bytes]:
        """The data of each server-sent event of a chunked reply, until the body ends."""
        buffer = b""
        while True:
            size = int(await asyncio.wait_for(self.reader.readline(), REPLY_TIMEOUT_S), 16)
            chunk = await asyncio.wait_for(self.reader.readexactly(size + 2), REPLY_TIMEOUT_S)
            if size == 0:
                return
            buffer += chunk[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                assert event.startswith(b"data: "), event
                yield event.removeprefix(b"data: ")


@contextlib.asynccontextmanager
async def raw_http(daemon: Daemon) -> AsyncIterator[RawHttp]:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port_of(daemon)), REPLY_TIMEOUT_S)
    try:
        yield RawHttp(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), REPLY_TIMEOUT_S)


async def test_a_client_that_stops_reading_is_cancelled_and_the_daemon_serves_on() -> None:
    config = {**LISTEN, "server": {"max_output_buffer_bytes": 1024},
              "generation": {"max_tokens": 4000}}
    async with running_daemon(config) as daemon:
        stalled = socket.socket()
        # A small receive window, so the kernel stops taking bytes early.
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        try:
            stalled.connect(("127.0.0.1", port_of(daemon)))
            stalled.sendall(request_bytes("/v1/completions", {
                "prompt": "Count from 1 to 1000: 1, 2, 3,", "stream": True,
                "max_tokens": 4000, "temperature": 0, "logprobs": 20}))
            # The socket buffers take tens of tokens first: minutes on a loaded machine.
            stats = await wait_for_outcome(daemon, "cancelled", 1, timeout=240)
        finally:
            stalled.close()
        # Far fewer tokens than asked: it was cut, not run to its end.
        assert stats["tokens"]["generated"] < 4000
        await daemon.log_with("stopped reading")
        async with raw_http(daemon) as http:
            http.writer.write(request_bytes("/v1/completions", {
                "prompt": "Hello", "max_tokens": 4, "temperature": 0}))
            status, body = await http.json_reply()
        assert status == 200 and body["usage"]["completion_tokens"] == 4


async def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests() -> None:
    async with running_daemon(LISTEN) as daemon:
        async with raw_http(daemon) as idle, raw_http(daemon) as streaming:
            # A keep-alive connection that stays open through the drain.
            idle.writer.write(request_bytes("/health", method="GET"))
            assert (await idle.json_reply())[0] == 200
            streaming.writer.write(request_bytes("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "stream": True, "max_tokens": 48, "temperature": 0,
                "stream_options": {"include_usage": True}}))
            status, headers = await streaming.head()
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            events = streaming.events()
            first = json.loads(await anext(events))
            assert first["choices"][0]["delta"]["role"] == "assistant"
            daemon.signal(signal.SIGTERM)
            await daemon.notification("STOPPING=1")
            idle.writer.write(request_bytes("/v1/completions", {"prompt": "Hi", "max_tokens": 2}))
            status, body = await idle.json_reply()
            assert status == 503 and body["error"]["code"] == "shutting_down"
            rest = [event async for event in events]
        assert rest[-1] == b"[DONE]"
        usage = json.loads(rest[-2])["usage"]
        assert usage["completion_tokens"] == 48
        text = "".join(json.loads(event)["choices"][0]["delta"].get("content") or ""
                       for event in rest[:-2])
        assert text
        assert await daemon.wait_exit() == 0


OVERSIZED_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n")
CHUNK = b"x" * (1 << 20)


async def send_body(writer: asyncio.StreamWriter, size: int | None) -> int:
    """Write `size` bytes of body, each MiB once the last is taken, or (None) MiB after
    MiB until the daemon closes; the bytes written."""
    sent = 0
    while size is None or sent < size:
        chunk = CHUNK if size is None else CHUNK[:size - sent]
        writer.write(chunk)
        try:
            await writer.drain()
        except ConnectionError:
            if size is None:
                return sent
            raise
        sent += len(chunk)
    return sent


async def test_a_client_that_sends_its_whole_oversized_body_reads_the_413() -> None:
    # Far more than the socket buffers hold past [server] max_line_bytes (1 MiB): closing
    # with it unread would reset the connection before the client read the 413. So too
    # for a 403 given before any of the body is read (a foreign Origin).
    size = 16 << 20
    foreign = OVERSIZED_HEAD.replace(b"Host:", b"Origin: http://evil.example\r\nHost:")
    async with running_daemon(LISTEN) as daemon:
        for head, expected, code in ((OVERSIZED_HEAD, 413, "line_too_long"),
                                     (foreign, 403, "forbidden")):
            async with raw_http(daemon) as http:
                http.writer.write(head % size)
                sender = asyncio.create_task(send_body(http.writer, size))
                try:
                    status, body = await http.json_reply()
                    # The whole body went out, no broken pipe; then the daemon's EOF.
                    assert await asyncio.wait_for(sender, REPLY_TIMEOUT_S) == size
                    assert await asyncio.wait_for(http.reader.read(), REPLY_TIMEOUT_S) == b""
                finally:
                    sender.cancel()
                assert status == expected and body["error"]["code"] == code, body
        # The daemon serves on.
        async with raw_http(daemon) as http:
            http.writer.write(request_bytes("/health", method="GET"))
            assert (await http.json_reply())[0] == 200


async def trickle(writer: asyncio.StreamWriter) -> None:
    """A byte at a time, well within LINGER_QUIET_S of each other, until the daemon
    closes."""
    while True:
        writer.write(b"x")
        try:
            await writer.drain()
        except ConnectionError:
            return
        await asyncio.sleep(0.2)


async def test_clients_that_never_stop_sending_are_closed_in_bounded_time() -> None:
    # One floods (the byte bound ends it), one trickles (the time bound does); both
    # past [server] max_line_bytes first, so each gets its 413 before anything else.
    async with running_daemon(LISTEN) as daemon, raw_http(daemon) as flood, \
            raw_http(daemon) as slow:
        for http in (flood, slow):
            http.writer.write(OVERSIZED_HEAD % (1 << 50))
            await send_body(http.writer, 2 << 20)
        trickling = asyncio.create_task(trickle(slow.writer))
        flooding: asyncio.Task[int] | None = None
        try:
            for http in (flood, slow):
                status, body = await http.json_reply()
                assert status == 413 and body["error"]["code"] == "line_too_long", body
            answered = time.monotonic()
            # The flood once its 413 is read: a write that fails on the closed connection
            # fails the client's reads too, and on a busy machine it could come first.
            flooding = asyncio.create_task(send_body(flood.writer, None))
            # The daemon serves others meanwhile.
            async with raw_http(daemon) as other:
                other.writer.write(request_bytes("/health", method="GET"))
                assert (await other.json_reply())[0] == 200
            health_s = time.monotonic() - answered
            # Read and dropped up to the lingering close's bounds, then closed: the
            # clients' writes fail.
            sent = await asyncio.wait_for(flooding, LINGER_TOTAL_S + REPLY_TIMEOUT_S)
            flood_s = time.monotonic() - answered
            await asyncio.wait_for(trickling, LINGER_TOTAL_S + REPLY_TIMEOUT_S)
            trickle_s = time.monotonic() - answered
        finally:
            if flooding is not None:
                flooding.cancel()
            trickling.cancel()
    # What the kernel's buffers hold besides the bound is far less than the bound again.
    assert sent < 2 * LINGER_MAX_BYTES, sent
    assert flood_s < LINGER_TOTAL_S + 10, flood_s
    # Not closed as quiet (a byte came every 0.2 s), but at the total bound.
    assert LINGER_QUIET_S < trickle_s < LINGER_TOTAL_S + 10, trickle_s
    print(f"after their 413s: a flood closed after {flood_s:.2f} s and "
          f"{sent / (1 << 20):.0f} MiB, a trickle after {trickle_s:.2f} s (bounds: "
          f"{LINGER_TOTAL_S:g} s, {LINGER_QUIET_S:g} s quiet, {LINGER_MAX_BYTES >> 20} MiB); "
          f"/health meanwhile in {health_s * 1000:.1f} ms")
