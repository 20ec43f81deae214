"""The OpenAI endpoint's limits and shutdown, over raw HTTP/1.1 on a real daemon.

Raw sockets, because what is tested is what a client library hides: a client that stops
reading, one connection too many, a keep-alive connection that asks while the daemon
drains, and a stream that goes on to its end after SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

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
