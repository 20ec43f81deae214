"""The HTTP listener's defences, on real daemons: a time limit on every phase of a
connection, room kept for real requests beside idle and half-sent connections, web pages
kept out (Host, Origin), `allowed_uids` on HTTP as on the socket, and no byte sequence
that reaches `internal` or leaves a traceback (the property test: test_openai_fuzz.py).

Two daemons, each shared by the module's tests (one event loop): one on loopback TCP with
short time limits, a listed origin and host, and allowed_uids = [0]; one on a Unix socket
with an API key and allowed_uids = [0]. Raw sockets throughout: what is tested is what a
client library hides or refuses to send.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/httpd/test_guard.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from sfcore_daemon.system import fdlimit
from tests.kit import run_cli, running_daemon
from tests.kit.http import (
    BODY_S,
    FIRST_S,
    HEADER_S,
    IDLE_S,
    MAX_CONNECTIONS,
    Listener,
    assert_clean_log,
    guarded_tcp,
    module_test,
    read_reply,
    request,
    url_target,
)

KEY = "guard-key"
WAIT_S = 30.0
NOBODY = 65534


def openai_error(status: int, body: bytes, expected: int, code: str | None = None) -> str:
    """The error's message, after checking OpenAI's shape."""
    assert status == expected, (status, body)
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    if code is not None:
        assert error["code"] == code, error
    message: str = error["message"]
    return message


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float:
    """Seconds until the daemon closes the connection (EOF or reset)."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionError):
        rest = await asyncio.wait_for(reader.read(), timeout)
        assert rest == b"", rest
    return time.monotonic() - started


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp() -> AsyncIterator[Listener]:
    async with guarded_tcp() as listener:
        yield listener


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def unix() -> AsyncIterator[Listener]:
    directory = tempfile.mkdtemp(prefix="sfg", dir="/tmp")  # sun_path holds 108 bytes
    os.chmod(directory, 0o711)  # the unprivileged client goes through it
    config = {"openai": {"listen": f"unix:{directory}/o.sock", "api_key": KEY,
                         "write_timeout_s": 1.0},
              "server": {"allowed_uids": [0], "socket_mode": "0666",
                         # Left to the write timeout, not to the generation's own limit.
                         "max_output_buffer_bytes": 1 << 28}}
    try:
        async with running_daemon(config) as daemon:
            yield Listener(daemon, url_target(daemon))
            assert await daemon.stop() == 0
            assert_clean_log(daemon)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@module_test
async def test_a_silent_connection_closes_after_first_request_timeout_an_idle_one_later(
        tcp: Listener) -> None:
    before = await tcp.http_stats()
    opened = time.monotonic()
    async with tcp.connection() as (silent, _), tcp.connection() as (served, writer):
        # One never sends a byte; the other sends its request at once, is served, and
        # is then idle between requests (keep-alive), under the other limit.
        writer.write(request("GET", "/health"))
        assert (await read_reply(served))[0] == 200
        answered = time.monotonic()
        await closed_within(silent, FIRST_S + 10)
        silent_s = time.monotonic() - opened
        await closed_within(served, IDLE_S + 10)
        idle_s = time.monotonic() - answered
    assert FIRST_S * 0.9 <= silent_s < FIRST_S + 5, silent_s
    assert IDLE_S * 0.9 <= idle_s < IDLE_S + 5, idle_s
    after = await tcp.http_stats()
    closed, was = after["closed"], before["closed"]
    assert closed["first_request_timeout"] >= was["first_request_timeout"] + 1, closed
    assert closed["idle_timeout"] >= was["idle_timeout"] + 1, closed
    print(f"closed: silent after {silent_s:.2f} s (first_request_timeout_s {FIRST_S:g}), "
          f"idle after {idle_s:.2f} s (idle_timeout_s {IDLE_S:g})")


@module_test
async def test_half_sent_headers_are_closed_after_header_timeout(tcp: Listener) -> None:
    async with tcp.connection() as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nHost: local")
        # Trickling more of them does not buy time: the limit counts from the first byte.
        await asyncio.sleep(HEADER_S / 2)
        writer.write(b"ho")
        waited = await closed_within(reader, HEADER_S + 10)
    assert waited < HEADER_S + 3


@module_test
async def test_a_half_sent_body_gets_408_after_body_timeout(tcp: Listener) -> None:
    before = await tcp.http_stats()
    async with tcp.connection() as (reader, writer):
        started = time.monotonic()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        status, headers, body = await read_reply(reader)
        elapsed = time.monotonic() - started
        assert "body_timeout_s" in openai_error(status, body, 408, "request_timeout")
        assert headers.get("connection") == "close"
        # At once, not after reading on for the rest of the body, nor at the idle limit.
        assert await closed_within(reader, WAIT_S) < IDLE_S
    assert BODY_S * 0.9 <= elapsed < BODY_S + 5
    after = await tcp.http_stats()
    assert after["closed"]["body_timeout"] == before["closed"]["body_timeout"] + 1
    assert after["responses"]["408"] == before["responses"]["408"] + 1


@module_test
async def test_health_answers_at_once_beside_hundreds_of_idle_and_half_sent(
        tcp: Listener) -> None:
    count = 300
    before = await tcp.http_stats()
    heads = [b"", b"GET /v1/models HTTP/1.1\r\nHost: loc",
             b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000\r\n\r\n{"]
    sockets = []
    try:
        for index in range(count):
            sock = tcp.blocking()
            sockets.append(sock)
            if heads[index % 3]:
                sock.sendall(heads[index % 3])
        started = time.monotonic()
        status, _, body = await tcp.exchange(request("GET", "/health"))
        health_s = time.monotonic() - started
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert health_s < 1.0, health_s
        # A real request gets in and is answered too.
        status, _, body = await tcp.exchange(request(
            "POST", "/v1/completions", body=b'{"prompt": "Hi", "max_tokens": 2}'))
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] <= 2
        # The daemon holds about max_connections of them, not all: its descriptors stay
        # within the budget it checked at start-up.
        descriptors = len(os.listdir(f"/proc/{tcp.daemon.process.pid}/fd"))
        assert descriptors < MAX_CONNECTIONS + 2 + fdlimit.MARGIN, descriptors
    finally:
        for sock in sockets:
            sock.close()
    after = await tcp.http_stats()
    assert after["closed"]["evicted"] >= before["closed"]["evicted"] + count - MAX_CONNECTIONS
    print(f"GET /health beside {count} idle and half-sent connections: "
          f"{health_s * 1000:.1f} ms")


@module_test
async def test_one_request_past_max_connections_busy_ones_gets_429() -> None:
    config = {"openai": {"listen": "127.0.0.1:0"}, "server": {"max_connections": 2}}
    # Two of these fit the KV pool (n_ctx 4096) side by side.
    streaming = request("POST", "/v1/completions", body=json.dumps({
        "prompt": "Count from 1 to 1000: 1, 2, 3,", "stream": True, "max_tokens": 1500,
        "temperature": 0}).encode())
    async with running_daemon(config) as daemon:
        listener = Listener(daemon, url_target(daemon))
        async with listener.connection() as (first, first_writer), \
                listener.connection() as (second, second_writer):
            for reader, writer in ((first, first_writer), (second, second_writer)):
                writer.write(streaming)
                head = await asyncio.wait_for(reader.readuntil(b"\n\n"), WAIT_S)
                assert head.startswith(b"HTTP/1.1 200"), head
            # Two requests run: a third gets 429 and its connection is closed.
            async with listener.connection() as (third, writer):
                writer.write(request("GET", "/health"))
                status, _, body = await read_reply(third)
                openai_error(status, body, 429, "too_many_connections")
                await closed_within(third, WAIT_S)
        # Once they are gone, all is served again.
        assert (await listener.exchange(request("GET", "/health")))[0] == 200
        stats = (await listener.http_stats())
        assert stats["closed"]["refused"] == 1 and stats["responses"]["429"] == 1


@module_test
async def test_a_reply_left_unread_is_aborted_after_write_timeout(unix: Listener) -> None:
    before = await unix.http_stats()
    metrics = request("GET", "/metrics", headers=[("Authorization", f"Bearer {KEY}")])
    sock = unix.blocking()
    try:
        # Far more reply bytes than the socket's buffers hold, and none of them read.
        sock.sendall(metrics * 300)
        # No event to wait on from outside: the counter is polled, bounded.
        async with asyncio.timeout(WAIT_S):
            while True:
                stats = await unix.http_stats()
                if stats["closed"]["write_timeout"] > before["closed"]["write_timeout"]:
                    break
                await asyncio.sleep(0.1)
    finally:
        sock.close()
    assert (await unix.exchange(request("GET", "/health")))[0] == 200


@module_test
async def test_foreign_host_and_origin_get_403_and_own_ones_are_served(tcp: Listener) -> None:
    port = tcp.port
    before = await tcp.http_stats()
    served = [f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost",
              "LOCALHOST", "proxy.example", "proxy.example:8443"]
    for host in served:
        assert (await tcp.exchange(request("GET", "/health", host=host)))[0] == 200, host
    refused = ["evil.example", f"evil.example:{port}", "localhost:1", "127.0.0.2",
               "localhost.evil.example", "\u00e9vil"]
    for host in refused:
        status, _, body = await tcp.exchange(request("GET", "/v1/models", host=host))
        assert "allowed_hosts" in openai_error(status, body, 403, "forbidden")
    # A form or a fetch without preflight from another page: refused before it runs.
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    for origin in ("http://evil.example", "null", f"http://localhost:{port + 1}"):
        status, headers, body = await tcp.exchange(request(
            "POST", "/v1/chat/completions", headers=[("Origin", origin),
                                                     ("Content-Type", "text/plain")],
            body=chat))
        assert "allowed_origins" in openai_error(status, body, 403, "forbidden")
        assert "access-control-allow-origin" not in headers
    # The listener's own origin, and the listed one (which gets CORS headers).
    status, headers, _ = await tcp.exchange(request(
        "GET", "/health", host=f"127.0.0.1:{port}",
        headers=[("Origin", f"http://127.0.0.1:{port}")]))
    assert status == 200 and "access-control-allow-origin" not in headers
    status, headers, _ = await tcp.exchange(request(
        "GET", "/health", headers=[("Origin", "https://app.example")]))
    assert status == 200
    assert headers["access-control-allow-origin"] == "https://app.example"
    status, headers, _ = await tcp.exchange(request(
        "OPTIONS", "/v1/chat/completions", headers=[
            ("Origin", "https://app.example"), ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", "authorization, content-type")]))
    assert status == 204
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in headers["access-control-allow-methods"]
    after = await tcp.http_stats()
    assert after["responses"]["403"] == before["responses"]["403"] + len(refused) + 3


@module_test
async def test_on_a_unix_listener_host_must_name_the_local_machine(unix: Listener) -> None:
    # curl --unix-socket and the SDKs' Unix transports send "localhost" (or the base
    # URL's name); any port is taken, as there is none.
    for host in ("localhost", "localhost:8080", "127.0.0.1", "[::1]"):
        assert (await unix.exchange(request("GET", "/health", host=host)))[0] == 200, host
    status, _, body = await unix.exchange(request("GET", "/health", host="evil.example"))
    openai_error(status, body, 403, "forbidden")


# The unprivileged client, standard library only: one request with Connection: close,
# then everything up to EOF; prints the status and the body.
CLIENT = r"""
import json, os, socket, sys
target, data = sys.argv[1], bytes.fromhex(sys.argv[2])
if target.startswith("unix:"):
    s = socket.socket(socket.AF_UNIX)
    address = target[5:]
else:
    s = socket.socket()
    address = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
s.settimeout(30)
s.connect(address)
s.sendall(data)
reply = b""
while chunk := s.recv(65536):
    reply += chunk
head, _, body = reply.partition(b"\r\n\r\n")
print(json.dumps({"uid": os.getuid(), "status": int(head.split()[1]),
                  "body": body.decode()}))
"""


async def request_as(uid: int, target: str, data: bytes) -> tuple[int, bytes]:
    process = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-I", "-c", CLIENT, target, data.hex(),
        user=uid, group=uid, extra_groups=[],
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd="/")
    try:
        out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["uid"] == uid
    return result["status"], result["body"].encode()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another uid needs root")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs /usr/bin/python3 for the unprivileged client")
@module_test
async def test_allowed_uids_refuse_another_user_on_http(tcp: Listener, unix: Listener) -> None:
    auth = [("Authorization", f"Bearer {KEY}"), ("Connection", "close")]
    for listener in (tcp, unix):
        data = request("GET", "/v1/models", headers=auth)
        # Root is listed; nobody, holding the key, is not.
        assert (await request_as(0, listener.target, data))[0] == 200
        status, body = await request_as(NOBODY, listener.target, data)
        message = openai_error(status, body, 403, "forbidden")
        assert "uid 65534" in message and "allowed_uids" in message, message
        # Not even /health: the socket refuses such a peer everything too.
        status, body = await request_as(NOBODY, listener.target,
                                        request("GET", "/health", headers=auth[1:]))
        openai_error(status, body, 403, "forbidden")


@module_test
async def test_invalid_utf8_in_a_body_is_400_and_in_authorization_401(
        tcp: Listener, unix: Listener) -> None:
    before = await tcp.http_stats()
    body = b'{"messages": [{"role": "user", "content": "caf\xc3\x28 \xff"}]}'
    status, _, reply = await tcp.exchange(request("POST", "/v1/chat/completions", body=body))
    assert "not valid JSON" in openai_error(status, reply, 400, "bad_json")
    # A path's bytes: percent-encoded or raw, a 404 or aiohttp's own 400, never a 500.
    status, _, reply = await tcp.exchange(request("GET", "/v1/models/%ff%fe"))
    openai_error(status, reply, 404)
    status, _, reply = await tcp.exchange(b"GET /v1/\xff HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert status == 400, reply
    # aiohttp answers Expect before any middleware, with the header's text in its 417.
    status, _, reply = await tcp.exchange(
        b"GET /health HTTP/1.1\r\nHost: localhost\r\nExpect: 100-\xac\r\n\r\n")
    openai_error(status, reply, 417, "expectation_failed")
    async with tcp.connection() as (reader, writer):
        writer.write(request("POST", "/v1/completions", headers=[("Expect", "100-continue")],
                             body=b'{"prompt": "Hi", "max_tokens": 1}'))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S) \
            == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert (await read_reply(reader))[0] == 200
    after = await tcp.http_stats()
    assert after["responses"]["400"] == before["responses"]["400"] + 2
    assert after["responses"]["417"] == before["responses"].get("417", 0) + 1
    before = await unix.http_stats()
    for value in (b"Bearer \xff\xfe", b"Bearer " + KEY.encode() + b"\xc3\xa9", b"\xe2\x82\xac"):
        status, _, reply = await unix.exchange(
            b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + value
            + b"\r\n\r\n")
        openai_error(status, reply, 401, "invalid_api_key")
    after = await unix.http_stats()
    assert after["responses"]["401"] == before["responses"]["401"] + 3


@module_test
async def test_http_counters_are_in_the_metrics(unix: Listener) -> None:
    status, _, body = await unix.exchange(request(
        "GET", "/metrics", headers=[("Authorization", f"Bearer {KEY}")]))
    assert status == 200
    text = body.decode()
    for line in ("# TYPE sfcore_http_connections gauge",
                 "# TYPE sfcore_http_connections_accepted_total counter",
                 'sfcore_http_connections_closed_total{reason="write_timeout"}',
                 'sfcore_http_responses_total{status="401"}',
                 'sfcore_http_responses_total{status="403"}',
                 'sfcore_http_responses_total{status="413"}',
                 'sfcore_http_responses_total{status="429"}'):
        assert line in text, line


@pytest.mark.asyncio
async def test_a_remote_listener_without_api_key_needs_an_explicit_opt_in(
        tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[openai]\nlisten = "0.0.0.0:0"\nallow_remote = true\n')
    code, output = await run_cli("--config", str(config), "--socket", str(tmp_path / "s"))
    assert code == 2 and output.count("\n") == 1, output
    assert "Traceback" not in output and "api_key" in output, output
    opted_in = {"openai": {"listen": "0.0.0.0:0", "allow_remote": True,
                           "allow_remote_without_key": True}}
    async with running_daemon(opted_in, wait_ready=False) as daemon:
        assert await daemon.stop() == 0  # its log is whole once it has exited
        assert "has no api_key and answers anyone" in daemon.log
