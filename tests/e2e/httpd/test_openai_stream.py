"""A streamed HTTP reply always ends whole (issue 50): when the generation ends while a
write waits for a slow reader, the last chunks, the finish reason, the usage and
`[DONE]` still follow. First the interleaving forced on the write loop itself, then a
real slow reader against the real daemon.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/httpd/test_openai_stream.py.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.kit import REPLY_TIMEOUT_S, running_daemon
from tests.kit.http import LISTEN, port_of, request_bytes, sse_chunks, wait_for_outcome

pytestmark = pytest.mark.asyncio


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
        chunks = sse_chunks(stream)
        streamed = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        async with daemon.client() as client:
            whole = await client.final({"prompt": body["prompt"], "max_tokens": 48,
                                        "temperature": 0, "stream": False})
        assert streamed == whole["text"]
