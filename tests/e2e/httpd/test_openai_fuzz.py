"""Arbitrary bytes at the HTTP listener (issue 50): methods, paths, header names and
values, bodies and their lengths, each usually what a client sends and now and then
anything at all. Every one gets a 2xx or 4xx (or a clean close), the log holds no
traceback, and the daemon answers afterwards. On the loopback daemon of
test_openai_guard.py (tests/kit/http.py's guarded_tcp; its own instance for this module)."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator

import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kit.http import Listener, assert_clean_log, guarded_tcp, module_test, request

_TOKEN = st.text(st.sampled_from("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCXYZ"),
                 min_size=1, max_size=12).map(str.encode)
_VISIBLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.encode)
# Each part of a request: what a client may send, and (one part per odd request) anything.
_PARTS: dict[str, tuple[st.SearchStrategy[bytes], st.SearchStrategy[bytes]]] = {
    "method": (st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD",
                                b"PATCH", b"TRACE"]),
               _TOKEN | st.sampled_from([b"CONNECT", b"PRI"]) | st.binary(max_size=8)),
    "path": (st.sampled_from([b"/health", b"/v1/health", b"/v1/models", b"/v1/models/x",
                              b"/metrics", b"/", b"/v1/chat/completions", b"/v1/completions",
                              b"/v1/responses", b"/v1/responses/resp_x",
                              b"http://localhost/health", b"/v1/models/%ff%00", b"/%2e%2e/"])
             | _TOKEN.map(lambda token: b"/" + token),
             st.sampled_from([b"*", b""]) | _VISIBLE | st.binary(max_size=30)),
    "host": (st.sampled_from([b"localhost", b"127.0.0.1", b"[::1]", b"proxy.example"]),
             st.sampled_from([b"evil.example", b"localhost:1", b""]) | _VISIBLE
             | st.binary(max_size=20)),
    "name": (st.sampled_from([b"Origin", b"Authorization", b"Content-Type", b"Content-Length",
                              b"Transfer-Encoding", b"Content-Encoding", b"Connection",
                              b"Expect", b"Upgrade", b"Accept"]) | _TOKEN,
             st.binary(min_size=1, max_size=12)),
    "value": (st.sampled_from([b"localhost", b"chunked", b"gzip", b"deflate", b"br",
                               b"100-continue", b"close", b"keep-alive", b"websocket",
                               b"application/json", b"text/plain", b"-1", b"0", b"99999999999",
                               b"http://evil.example", b"https://app.example", b"Bearer x",
                               b"null"]) | _VISIBLE,
              st.binary(max_size=40)),
}
_BODIES = st.sampled_from([b"", b"{}", b'{"prompt": "Hi", "max_tokens": 1}',
                           b'{"messages": [{"role": "user", "content": "Hi"}]}',
                           b'{"messages": [{"role": "user", "content": "\xff"}]}',
                           b'{"prompt": "Hi", "stream": true, "max_tokens": 2}',
                           b"\x1f\x8b\x08\x00garbage", b"0\r\n\r\n",
                           b"5\r\nhello\r\n0\r\n\r\n"]) | _VISIBLE | st.binary(max_size=200)


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """A request whose parts are what clients send, except (one time in three) one part
    that is anything at all; its Content-Length right, wrong or absent."""
    odd = draw(st.sampled_from([*[None] * 2 * len(_PARTS), *_PARTS]))

    def part(name: str) -> bytes:
        usual, anything = _PARTS[name]
        return draw(anything if name == odd else usual)

    head = [part("method") + b" " + part("path") + b" HTTP/1.1", b"Host: " + part("host")]
    for _ in range(draw(st.integers(0, 4))):
        head.append(part("name") + b": " + part("value"))
    body = draw(_BODIES)
    if draw(st.booleans()):
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _one_exchange(target: str, data: bytes) -> bytes:
    """The daemon's first line for `data` (b"" if it closed without one)."""
    sock = socket.create_connection(("127.0.0.1", int(target.rsplit(":", 1)[1])),
                                    timeout=10)
    try:
        sock.sendall(data)
        received = b""
        while b"\r\n" not in received:
            try:
                chunk = sock.recv(4096)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
        return received.split(b"\r\n", 1)[0] if b"\r\n" in received else received
    finally:
        sock.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp() -> AsyncIterator[Listener]:
    async with guarded_tcp() as listener:
        yield listener


@module_test
async def test_arbitrary_requests_get_a_2xx_or_4xx_and_leave_no_traceback(
        tcp: Listener) -> None:
    seen: dict[bytes, int] = {}

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=http_requests())
    def exchange(data: bytes) -> None:
        first = _one_exchange(tcp.target, data)
        assert first == b"" or re.fullmatch(rb"HTTP/1\.[01] [124]\d\d .*", first), (data, first)
        seen[first[:12]] = seen.get(first[:12], 0) + 1

    await asyncio.to_thread(exchange)
    assert (await tcp.exchange(request("GET", "/health")))[0] == 200
    assert_clean_log(tcp.daemon)
    print("first lines:", seen)
