"""Streams that wait for a slot (issue 64): every server-sent stream gets its headers and
`: keep-alive` comments before its first event, the SDKs still parse it, Ollama's NDJSON
gets none; the X-Sfcore-Priority header puts a request in its class, and a bad one is
a 400 in the API's own shape.

One slot, held over the NDJSON socket by a request whose grammar never completes until
the test cancels it, so every HTTP request surely waits; `[openai] keepalive_s` is
short, and every wait is on bytes or a reply line, none on a clock.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.kit import Client, done_of, running_daemon
from tests.kit.daemon import Daemon
from tests.kit.faults import health, poll_until
from tests.kit.http import MODEL_ID, port_of, read_reply, request, sse_chunks, url_of

pytestmark = pytest.mark.asyncio

KEEPALIVE = b": keep-alive\n\n"
CONFIG = {"openai": {"listen": "127.0.0.1:0", "keepalive_s": 0.2}, "server": {"slots": 1}}
RUNNER = {"id": "runner", "prompt": "Write.", "grammar": "root ::= [a-z ] root",
          "temperature": 0, "max_tokens": 2000}
WAIT_S = 120.0
HI = [{"role": "user", "content": "Hi"}]
# Each streamed API's path, body, and its last event (cut at max tokens).
SSE_STREAMS: dict[str, tuple[dict[str, Any], bytes]] = {
    "/v1/chat/completions": ({"model": MODEL_ID, "messages": HI, "max_tokens": 4,
                              "temperature": 0, "stream": True}, b"data: [DONE]\n\n"),
    "/v1/completions": ({"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4,
                         "temperature": 0, "stream": True}, b"data: [DONE]\n\n"),
    "/v1/responses": ({"model": MODEL_ID, "input": "Hi", "max_output_tokens": 4,
                       "temperature": 0, "stream": True, "store": False},
                      b"event: response.incomplete"),
    "/v1/messages": ({"model": MODEL_ID, "messages": HI, "max_tokens": 4, "temperature": 0,
                      "stream": True}, b"message_stop"),
}
OLLAMA = ("/api/generate", {"model": "m", "prompt": "Hi", "stream": True,
                            "options": {"num_predict": 4, "temperature": 0}})
PRIORITY = "X-Sfcore-Priority"


class Raw:
    """One HTTP/1.1 request on a connection of its own, its reply read as it comes."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.data = b""

    @classmethod
    async def post(cls, daemon: Daemon, path: str, body: dict[str, Any],
                   headers: list[tuple[str, str]] | None = None) -> Raw:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port_of(daemon)), WAIT_S)
        writer.write(request("POST", path, body=json.dumps(body).encode(), headers=[
            ("Content-Type", "application/json"), ("anthropic-version", "2023-06-01"),
            *(headers or [])]))
        await writer.drain()
        return cls(reader, writer)

    async def read_until(self, marker: bytes) -> bytes:
        async with asyncio.timeout(WAIT_S):
            while marker not in self.data:
                chunk = await self.reader.read(65536)
                assert chunk, f"closed before {marker!r}: {self.data!r}"
                self.data += chunk
        return self.data

    async def whole(self) -> tuple[bytes, bytes]:
        """The head and the de-chunked body, once the body's last chunk is in."""
        await self.read_until(b"\r\n0\r\n\r\n")
        head, _, chunked = self.data.partition(b"\r\n\r\n")
        body = b""
        while chunked:
            size_line, _, rest = chunked.partition(b"\r\n")
            size = int(size_line, 16)
            body, chunked = body + rest[:size], rest[size + 2:]
        return head, body

    async def close(self) -> None:
        self.writer.close()
        await asyncio.wait_for(self.writer.wait_closed(), WAIT_S)


async def hold_the_slot(daemon: Daemon) -> Client:
    runner = await daemon.connect()
    await runner.start_streaming(RUNNER)
    return runner


async def free_the_slot(runner: Client) -> None:
    await runner.send({"op": "cancel", "target": "runner"})
    assert done_of(await runner.reply(WAIT_S))["finish_reason"] == "cancelled"
    await runner.close()


async def test_waiting_streams_get_keep_alives_before_their_first_event() -> None:
    async with running_daemon(CONFIG) as daemon:
        runner = await hold_the_slot(daemon)
        # Ollama's, in the background class: the NDJSON probe below goes ahead of it.
        ollama = await Raw.post(daemon, *OLLAMA, headers=[(PRIORITY, "background")])
        await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                         timeout=30, what="Ollama's request queued")
        streams = {path: await Raw.post(daemon, path, body)
                   for path, (body, _) in SSE_STREAMS.items()}
        for path, raw in streams.items():
            data = await raw.read_until(KEEPALIVE)
            head, _, before = data.partition(b"\r\n\r\n")
            # The headers first, then comments only: no event has come yet.
            assert head.startswith(b"HTTP/1.1 200"), (path, head)
            assert b"content-type: text/event-stream" in head.lower(), (path, head)
            assert b"data:" not in before and b"event:" not in before, (path, before)
        probe = await daemon.connect()
        await probe.send({"id": "probe", "prompt": "Hi", "max_tokens": 4, "temperature": 0})
        # Behind the four interactive streams, ahead of the background one.
        assert await probe.recv(WAIT_S) == {"type": "queued", "id": "probe", "position": 5,
                                            "queue_depth": 6}
        await free_the_slot(runner)
        for path, raw in streams.items():
            head, body = await raw.whole()
            end = SSE_STREAMS[path][1]
            assert end in body, (path, body)
            # Comments only before the first event; the events are whole after them.
            events = body.split(b"\n\n")
            first = next(i for i, event in enumerate(events) if not event.startswith(b":"))
            assert first >= 1 and all(not event.startswith(b":") for event in events[first:])
            if path in ("/v1/chat/completions", "/v1/completions"):
                assert sse_chunks(body)[-1]["choices"][0]["finish_reason"] == "length"
            await raw.close()
        assert done_of(await probe.reply(WAIT_S))["usage"]["completion_tokens"] == 4
        await probe.close()
        head, body = await ollama.whole()
        assert head.startswith(b"HTTP/1.1 200") and b"keep-alive" not in body, body
        lines = [json.loads(line) for line in body.splitlines()]
        assert lines[-1]["done"] is True, lines
        await ollama.close()


async def test_the_openai_sdk_parses_a_stream_that_began_with_keep_alives() -> None:
    import openai

    # Reproducible: the reference below reads the prompt from the stream's cached cells, and
    # outside that mode a near-tie may go another way (as on an AVX2-only CPU it did).
    async with running_daemon({**CONFIG, "model": {"reproducible": True}}) as daemon:
        runner = await hold_the_slot(daemon)
        client = openai.AsyncOpenAI(base_url=url_of(daemon) + "/v1", api_key="unused",
                                    max_retries=0, timeout=WAIT_S)
        async with client:
            # The headers come with the first keep-alive, long before the first token.
            stream = await asyncio.wait_for(client.chat.completions.create(
                model=MODEL_ID, messages=HI, max_tokens=4,  # type: ignore[arg-type]
                temperature=0, stream=True), WAIT_S)
            state = await health(daemon)
            assert state["slots_busy"] == 1 and state["queue_depth"] == 1, state
            await free_the_slot(runner)
            chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks
                       if chunk.choices)
        async with daemon.client() as ndjson:
            alone = await ndjson.final({"op": "chat", "messages": HI, "max_tokens": 4,
                                        "temperature": 0, "stream": False}, WAIT_S)
        assert text == alone["text"]


BAD_HEADER_CASES = [
    ("/v1/chat/completions", SSE_STREAMS["/v1/chat/completions"][0], "openai"),
    ("/v1/responses", SSE_STREAMS["/v1/responses"][0], "openai"),
    ("/v1/messages", SSE_STREAMS["/v1/messages"][0], "anthropic"),
    ("/api/chat", {"model": "m", "messages": HI, "options": {"num_predict": 2}}, "ollama"),
]


async def test_a_bad_priority_header_is_a_400_in_the_apis_own_shape() -> None:
    async with running_daemon({"openai": {"listen": "127.0.0.1:0"}}) as daemon:
        for path, body, shape in BAD_HEADER_CASES:
            raw = await Raw.post(daemon, path, {**body, "stream": False},
                                 headers=[(PRIORITY, "urgent")])
            status, _, data = await read_reply(raw.reader)
            await raw.close()
            error = json.loads(data)
            assert status == 400, (path, error)
            message = error["error"] if shape == "ollama" else error["error"]["message"]
            assert PRIORITY in message and "'urgent'" in message, (path, error)
            if shape == "anthropic":
                assert error["type"] == "error", error
                assert error["error"]["type"] == "invalid_request_error", error
            if shape == "openai":
                assert error["error"]["code"] == "invalid_request", error
            # The same request with a good header is served.
            good = await Raw.post(daemon, path, {**body, "stream": False},
                                  headers=[(PRIORITY, "background")])
            status, _, data = await read_reply(good.reader)
            await good.close()
            assert status == 200, (path, data)
