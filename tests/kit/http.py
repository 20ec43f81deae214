"""The HTTP listener's test helpers, shared by tests/e2e/openai, responses, anthropic and
httpd (and the unit test of the streamed reply):

- where a daemon's listener is: `url_of`, `url_target`, `port_of` (from its READY=1);
- `Endpoint`/`endpoint`: a daemon with its listener, spoken to through the vendors' SDKs
  (`sdk()`, OpenAI's) or httpx (`http()`), and `raises` for an SDK's error;
- `Listener`: raw sockets to a listener (`request` builds the bytes, `read_reply` reads
  a whole reply), and `guarded_tcp`, the loopback daemon with short time limits that
  test_openai_guard.py and test_openai_fuzz.py both take;
- `request_bytes`, `wait_for_outcome`, `sse_chunks`: a JSON request's bytes, a request
  outcome counted in the stats, a streamed reply's chunks.

The SDKs (openai, httpx2) are imported where they are used: a unit test that parses a
stream takes this module without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from tests.kit.daemon import Daemon, running_daemon
from tests.kit.ndjson import REPLY_TIMEOUT_S

if TYPE_CHECKING:
    import httpx2
    import openai

# Module-scoped daemons share one event loop with their tests.
module_test = pytest.mark.asyncio(loop_scope="module")

MODEL_ID = "gemma-3-270m-q4_k_m"
KEY = "sekret"  # the API key of an Endpoint's daemon that has one
WAIT_S = 60.0  # an Endpoint's client's timeout
LISTEN = {"openai": {"listen": "127.0.0.1:0"}}  # a listener on a free loopback port
# A small closed schema the structured-output tests of the HTTP APIs ask for.
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


# --- where the listener is -----------------------------------------------------------------


def url_of(daemon: Daemon) -> str:
    """The listener's URL as READY=1 names it: http://HOST:PORT or unix:/path."""
    ready = next(note for note in daemon.notifications if note.startswith("READY=1"))
    match = re.search(r"OpenAI API on (\S+)", ready)
    assert match, ready
    return match[1]


def url_target(daemon: Daemon) -> str:
    """HOST:PORT or unix:/path."""
    return url_of(daemon).removeprefix("http://")


def port_of(daemon: Daemon) -> int:
    return int(url_target(daemon).rsplit(":", 1)[1])


# --- through the SDKs ----------------------------------------------------------------------


@dataclass
class Endpoint:
    daemon: Daemon
    url: str  # http://127.0.0.1:PORT, or unix:/path

    def sdk(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        import httpx2
        import openai

        if self.url.startswith("unix:"):
            return openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key=api_key, max_retries=0, timeout=WAIT_S,
                http_client=httpx2.AsyncClient(
                    transport=httpx2.AsyncHTTPTransport(uds=self.url.removeprefix("unix:"))))
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                                  timeout=WAIT_S)

    def http(self) -> httpx2.AsyncClient:
        import httpx2

        if self.url.startswith("unix:"):
            return httpx2.AsyncClient(
                base_url="http://localhost", timeout=WAIT_S,
                transport=httpx2.AsyncHTTPTransport(uds=self.url.removeprefix("unix:")))
        return httpx2.AsyncClient(base_url=self.url, timeout=WAIT_S)

    async def stats(self) -> dict[str, Any]:
        async with self.daemon.client() as client:
            return await client.final({"op": "stats"})

    async def wait_stats(self, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Stats once `check` holds. The daemon has no event for "a generation ended",
        so this polls, bounded by WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            stats = await self.stats()
            if check(stats):
                return stats
            assert time.monotonic() < deadline, f"stats never matched: {stats}"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def endpoint(config: dict[str, Any]) -> AsyncIterator[Endpoint]:
    async with running_daemon(config) as daemon:
        yield Endpoint(daemon, url_of(daemon))


async def raises(call: Awaitable[Any], kind: type[openai.APIStatusError]) -> Any:
    with pytest.raises(kind) as caught:
        await call
    return caught.value


# --- raw sockets ---------------------------------------------------------------------------

LISTENER_WAIT_S = 30.0  # a Listener's bound on each step


@dataclass
class Listener:
    daemon: Daemon
    target: str  # "127.0.0.1:PORT" or "unix:/path"

    @property
    def port(self) -> int:
        return int(self.target.rsplit(":", 1)[1])

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.target.startswith("unix:"):
            return await asyncio.wait_for(
                asyncio.open_unix_connection(self.target.removeprefix("unix:")),
                LISTENER_WAIT_S)
        return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.port),
                                      LISTENER_WAIT_S)

    def blocking(self) -> socket.socket:
        if self.target.startswith("unix:"):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(LISTENER_WAIT_S)
            sock.connect(self.target.removeprefix("unix:"))
            return sock
        return socket.create_connection(("127.0.0.1", self.port), timeout=LISTENER_WAIT_S)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[tuple[asyncio.StreamReader,
                                                      asyncio.StreamWriter]]:
        reader, writer = await self.open()
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.wait_closed(), LISTENER_WAIT_S)

    async def exchange(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        async with self.connection() as (reader, writer):
            writer.write(data)
            return await read_reply(reader)

    async def http_stats(self) -> dict[str, Any]:
        async with self.daemon.client() as client:
            stats: dict[str, Any] = (await client.final({"op": "stats"}))["http"]
            return stats


def request(method: str, path: str, *, host: str | None = "localhost",
            headers: Iterable[tuple[str, str]] = (), body: bytes | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{name}: {value}" for name, value in headers]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + (body or b"")


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), LISTENER_WAIT_S)
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), LISTENER_WAIT_S)
    return int(status_line.split()[1]), headers, body


def assert_clean_log(daemon: Daemon) -> None:
    log = daemon.log
    assert "Traceback" not in log, log
    assert " ERROR " not in log and " CRITICAL " not in log, log


# The loopback listener with short time limits, a listed origin and host, and
# allowed_uids = [0] (test_openai_guard.py's `tcp`, and test_openai_fuzz.py's).
IDLE_S = 2.0
FIRST_S = 1.0  # shorter than IDLE_S: a silent new connection goes first
HEADER_S = 1.0
BODY_S = 1.0
MAX_CONNECTIONS = 32
GUARDED_TCP: dict[str, Any] = {
    "openai": {"listen": "127.0.0.1:0", "first_request_timeout_s": FIRST_S,
               "header_timeout_s": HEADER_S,
               "body_timeout_s": BODY_S, "allowed_origins": ["https://app.example"],
               "allowed_hosts": ["proxy.example"]},
    "server": {"idle_timeout_s": IDLE_S, "max_connections": MAX_CONNECTIONS,
               "allowed_uids": [0], "max_line_bytes": 65536},
    "generation": {"max_tokens": 4},
}


@contextlib.asynccontextmanager
async def guarded_tcp() -> AsyncIterator[Listener]:
    """A daemon on GUARDED_TCP; it must exit 0 with a clean log (no traceback, no ERROR)."""
    async with running_daemon(GUARDED_TCP) as daemon:
        listener = Listener(daemon, url_target(daemon))
        assert listener.target.startswith("127.0.0.1:"), listener.target
        yield listener
        assert await daemon.stop() == 0  # its log is whole once it has exited
        assert_clean_log(daemon)


# --- JSON requests, outcomes, streams ------------------------------------------------------


def request_bytes(path: str, body: dict[str, Any] | None = None, method: str = "POST") -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def wait_for_outcome(daemon: Daemon, outcome: str, count: int,
                           timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
    """Poll `stats` until `outcome` reaches `count` (the daemon has no event to wait on
    from outside; each poll is one request, bounded overall)."""
    async with daemon.client() as client:
        async with asyncio.timeout(timeout):
            while True:
                stats = await client.final({"op": "stats"})
                if stats["requests"]["by_outcome"][outcome] >= count:
                    return stats
                await asyncio.sleep(0.1)


def sse_chunks(stream: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed reply's body (server-sent events), which ends in
    `[DONE]`; comments (`: keep-alive` while it waited) are passed over."""
    events = [event.removeprefix(b"data: ") for event in stream.split(b"\n\n")
              if event and not event.startswith(b":")]
    assert events[-1] == b"[DONE]"
    return [json.loads(event) for event in events[:-1]]
