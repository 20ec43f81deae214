"""A streamed HTTP reply always ends whole (issue 50): when the generation ends while a
write waits for a slow reader, the last chunks, the finish reason, the usage and
`[DONE]` still follow. First the interleaving forced on the write loop itself, then a
real slow reader against the real daemon."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from sfcore_daemon.core.result import Result, Timings, Usage
from sfcore_daemon.httpd.api import pump
from sfcore_daemon.httpd.reply import HttpReply
from sfcore_daemon.openai.shapes import DONE_EVENT, ChatShape
from tests.harness import REPLY_TIMEOUT_S, running_daemon
from tests.test_openai_limits import LISTEN, port_of, request_bytes, wait_for_outcome

pytestmark = pytest.mark.asyncio


def _done(text: str) -> Result:
    return Result(
        id="r", text=text, finish_reason="length", stop_sequence=None, truncated=False,
        usage=Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=2, drafted_tokens=0,
                    accepted_tokens=0),
        timings=Timings(queued_ms=0, prompt_ms=1, prompt_tok_s=1, first_token_ms=1,
                        decode_ms=1, decode_tok_s=1, total_ms=1, cache_source="none"))


def _chunks(stream: bytes) -> list[dict[str, Any]]:
    events = [event.removeprefix(b"data: ") for event in stream.split(b"\n\n") if event]
    assert events[-1] == b"[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("ends_during_write", [1, 2])
async def test_a_reply_that_ends_while_a_write_waits_still_sends_its_closing(
        ends_during_write: int) -> None:
    reply = HttpReply(ChatShape("m", "fp", include_usage=True), True, 1 << 20, lambda _: None)
    reply.token("Hello", None)
    reply.flush()
    written: list[bytes] = []

    more = [" world", "!"][:ends_during_write]
    whole = "Hello" + "".join(more)

    async def slow_write(data: bytes) -> None:
        written.append(data)
        await asyncio.sleep(0)  # the reader is slow: the generation goes on meanwhile
        if more:
            reply.token(more.pop(0), None)
            reply.flush()
            if not more:
                reply.done(_done(whole))

    await asyncio.wait_for(pump(reply, slow_write), REPLY_TIMEOUT_S)
    stream = b"".join(written)
    assert stream.endswith(DONE_EVENT)
    chunks = _chunks(stream)
    text = "".join(chunk["choices"][0]["delta"].get("content") or ""
                   for chunk in chunks if chunk["choices"])
    assert text == whole
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1] \
        == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2


async def test_a_slow_reader_gets_the_whole_stream_equal_to_the_whole_reply() -> None:
    body = {"prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 48, "temperature": 0,
            "logprobs": 5}
    async with running_daemon(LISTEN) as daemon:
        loop = asyncio.get_running_loop()
        slow = socket.socket()
        # A small window: the daemon's writes wait on this reader long before the end.
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        slow.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(slow, ("127.0.0.1", port_of(daemon))),
                                   REPLY_TIMEOUT_S)
            await loop.sock_sendall(slow, request_bytes("/v1/completions",
                                                        {**body, "stream": True}))
            # Nothing is read until the generation has ended behind the waiting write.
            await wait_for_outcome(daemon, "length", 1)
            received = b""
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                while not received.endswith(b"0\r\n\r\n"):
                    data = await loop.sock_recv(slow, 65536)
                    assert data, "the stream was closed before its end"
                    received += data
        finally:
            slow.close()
        head, _, chunked = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        stream = b""
        while chunked:
            size_line, _, rest = chunked.partition(b"\r\n")
            size = int(size_line, 16)
            stream, chunked = stream + rest[:size], rest[size + 2:]
        chunks = _chunks(stream)
        streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        async with daemon.client() as client:
            whole = await client.final({"prompt": body["prompt"], "max_tokens": 48,
                                        "temperature": 0, "stream": False})
        assert streamed == whole["text"]
