"""The OpenAI-endpoint section of scripts/bench.py (`scripts/bench.py openai`): one client's decode
rate and first token through the daemon's `/v1/chat/completions` (streamed, server-sent
events over HTTP/1.1), against the same daemon's NDJSON `chat` op and against llama-server's
`/v1/chat/completions` (`--llama-server PATH` or LLAMA_SERVER; without it the section runs
without that column), in the same run.

Sides, all up together: one daemon with `[openai] listen = "127.0.0.1:0"` (the port read
from its READY notification) and `[speculative] mode = "off"`, taking both the NDJSON and
the HTTP requests; llama-server with `-np 1`, the daemon's n_ctx, threads and CPUs, no
draft, `--no-jinja --chat-template gemma` (the default model carries no template: the daemon
picks llama.cpp's built-in "gemma" for it; llama-server's Jinja engine, on by default, would
take "gemma" for a template's text). So every side
makes one token a step from the same rendered prompt; the prompt token counts are shown.

Every request is greedy (temperature 0, top_k 1), `--tokens` tokens, streamed, and has a
prompt of its own: the same user message with a different three-digit number in front.
Both daemon paths share one KV cache, so the same prompt sent twice would be a cache hit
the second time; with a number of its own each request is cold past the chat template's
first tokens (which every side reuses alike). Each run sends PROMPTS_PER_RUN requests to
every side, one right after the other, the side order rotating by request, so a drifting
machine hits all sides alike; a run's figure per side is the median of its requests. One
unmeasured round first (first-touch page faults, start-up costs).

First token: client-side, from writing the request to reading the first line or event
that carries text. Decode: client-side, (completion tokens - 1) / (time from the first
text to the last); besides, what each server reports of itself (NDJSON `timings`; the
daemon's HTTP replies carry none; llama-server's last chunk's `timings`). The HTTP client
is a minimal asyncio HTTP/1.1 one on a keep-alive connection, the same code for the daemon
and llama-server; the NDJSON client is benchlib's Stream, also asyncio on one connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from benchkit.common import TIMEOUT_S, decode_reply, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.peers import LlamaServer, peer_paths
from benchkit.table import cell, summary

HELP = "one client through /v1/chat/completions against NDJSON chat and llama-server"

Runner = Callable[[Coroutine[Any, Any, Any]], Any]

PROMPTS_PER_RUN = 3
KEEPALIVE_S = 2.0
USER_MESSAGE = ("{number}. Write a long, detailed story about a lighthouse keeper who finds "
                "a message in a bottle.")
DAEMON_CONFIG = '[openai]\nlisten = "127.0.0.1:0"\n[speculative]\nmode = "off"\n'
SIDES = ("ndjson", "http", "llama-server")
LABELS = {"ndjson": "daemon, NDJSON chat", "http": "daemon, /v1/chat/completions",
          "llama-server": "llama-server, /v1/chat/completions"}
ENDPOINT = re.compile(r"OpenAI API on http://([0-9.]+):(\d+)")


def messages(number: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": USER_MESSAGE.format(number=number)}]


class HttpChat:
    """One keep-alive HTTP/1.1 connection streaming /v1/chat/completions, timed at the
    arrival of every event. Lean for the same reason as benchlib's Stream: it shares the
    CPUs with the server it measures."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.idle_since = 0.0

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection kept alive, or a fresh one where the server closed it or
        may have: llama-server closes its connection after every streamed reply, and
        one idle for 5 s (cpp-httplib's keep-alive). A fresh one first answers GET
        /health, untimed, so that the server's accepting it is not timed either."""
        if (self.reader is None or self.writer is None or self.reader.at_eof()
                or time.monotonic() - self.idle_since > KEEPALIVE_S):
            await self.close()
            self.reader, self.writer = await asyncio.open_connection(
                self.host, self.port, limit=1 << 22)
            self.writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                              f"\r\n".encode())
            async with asyncio.timeout(TIMEOUT_S):
                status, headers = await self._head(self.reader)
                await self._whole(self.reader, headers)
            if status != 200:
                raise RuntimeError(f"GET /health answered {status}")
        return self.reader, self.writer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()
        self.reader = self.writer = None

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Figures of one streamed chat completion (the connection reopened as needed)."""
        reader, started = await self._post("/v1/chat/completions", body)
        first = last = 0.0
        pieces = 0
        usage: dict[str, Any] = {}
        timings: dict[str, Any] = {}
        decode = decode_reply
        async with asyncio.timeout(TIMEOUT_S):
            headers = await self._streamed_head(reader)
            async for now, data in self._events(reader, headers):
                chunk = decode(data)
                for choice in chunk.get("choices") or ():
                    if (choice.get("delta") or {}).get("content"):
                        first = first or now
                        last = now
                        pieces += 1
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
        await self._done_with(headers)
        # Without usage (a server that ignores stream_options): one text event a token.
        tokens = int(usage.get("completion_tokens", pieces))
        details = usage.get("prompt_tokens_details") or {}
        return {
            "first_token_ms": (first - started) * 1e3 if first else math.nan,
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first
            else math.nan,
            "tokens": tokens, "prompt_tokens": int(usage.get("prompt_tokens", 0)),
            "cached_tokens": int(details.get("cached_tokens", timings.get("cache_n", 0))),
            "server_decode_tok_s": float(timings.get("predicted_per_second", math.nan)),
            "server_first_token_ms": float(timings.get("prompt_ms", math.nan)),
        }

    async def _post(self, path: str, body: dict[str, Any]
                    ) -> tuple[asyncio.StreamReader, float]:
        """Send a streamed request for `path` (the connection opened before the clock
        starts); the reader and the perf_counter() of the send."""
        reader, writer = await self._connect()
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        started = time.perf_counter()
        writer.write(head + payload)
        return reader, started

    async def _streamed_head(self, reader: asyncio.StreamReader) -> dict[str, str]:
        """The headers of a streamed reply; RuntimeError with the body unless 200."""
        status, headers = await self._head(reader)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {await self._whole(reader, headers)!r}")
        return headers

    @staticmethod
    async def _events(reader: asyncio.StreamReader, headers: dict[str, str]
                      ) -> AsyncIterator[tuple[float, bytes]]:
        """Each server-sent event's data (but `[DONE]`) to the end of the body, with the
        perf_counter() of the read that brought it."""
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        remaining = int(headers.get("content-length", "-1"))
        readline, readexactly, read = reader.readline, reader.readexactly, reader.read
        buffer = b""
        while True:
            if chunked:
                size = int((await readline()).split(b";")[0], 16)
                if size == 0:
                    await readline()  # the empty trailer
                    return
                data = (await readexactly(size + 2))[:-2]
            else:
                if remaining == 0:
                    return
                data = await read(65536 if remaining < 0 else min(65536, remaining))
                if not data:
                    return
                remaining -= len(data) if remaining > 0 else 0
            now = time.perf_counter()
            buffer += data.replace(b"\r\n", b"\n") if b"\r" in data else data
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        yield now, line[5:]

    async def _done_with(self, headers: dict[str, str], close: bool = False) -> None:
        """After a whole reply: keep the connection unless `close` or the server ends it."""
        self.idle_since = time.monotonic()
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if (close or (not chunked and "content-length" not in headers)
                or headers.get("connection", "").lower() == "close"):
            await self.close()

    @staticmethod
    async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
        line = await reader.readline()
        if not line:
            raise RuntimeError("the server closed the connection")
        status = int(line.split()[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    @staticmethod
    async def _whole(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        """A body that is not streamed: GET /health's, an error's."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int((await reader.readline()).split(b";")[0], 16):
                body += (await reader.readexactly(size + 2))[:-2]
            await reader.readline()
            return body
        return await reader.readexactly(int(headers.get("content-length", "0")))


def chat_body(number: int, tokens: int) -> dict[str, Any]:
    return {"messages": messages(number), "max_tokens": tokens, "temperature": 0.0,
            "top_k": 1, "stream": True, "stream_options": {"include_usage": True}}


async def ndjson_chat(stream: Stream, number: int, tokens: int) -> dict[str, Any]:
    figures = await stream.figures({"op": "chat", "messages": messages(number),
                                    "max_tokens": tokens, "temperature": 0.0, "top_k": 1,
                                    "stream": True})
    timings = figures.pop("done")["timings"]
    figures["server_decode_tok_s"] = float(timings["decode_tok_s"])
    figures["server_first_token_ms"] = float(timings["first_token_ms"])
    return figures


async def measure(params: dict[str, Any], runs: int, llama_server: str | None
                  ) -> dict[str, list[dict[str, Any]]]:
    """Every run's figures per side: the median of its requests' figures."""
    tokens = params["tokens"]
    daemon = await Daemon.start(params, config=DAEMON_CONFIG)
    server: LlamaServer | None = None
    clients: list[HttpChat] = []
    stream: Stream | None = None
    try:
        found = ENDPOINT.search(daemon.ready_status)
        if found is None:
            raise RuntimeError(f"no OpenAI address in the daemon's READY status: "
                               f"{daemon.ready_status!r}")
        stream = ndjson = await Stream.open(daemon.socket_path)
        http = HttpChat(found[1], int(found[2]))
        clients.append(http)
        sides: dict[str, Callable[[int], Coroutine[Any, Any, dict[str, Any]]]] = {
            "ndjson": lambda number: ndjson_chat(ndjson, number, tokens),
            "http": lambda number: http.chat(chat_body(number, tokens)),
        }
        if llama_server:
            server = await asyncio.to_thread(LlamaServer.start, llama_server, params, 1,
                                             ["--no-jinja", "--chat-template", "gemma"])
            peer = HttpChat("127.0.0.1", server.port)
            clients.append(peer)
            sides["llama-server"] = lambda number: peer.chat(chat_body(number, tokens))
        names = list(sides)
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        number = 100
        for index in range(runs + 1):
            requests: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
            for k in range(PROMPTS_PER_RUN if index else 1):
                shift = (index * PROMPTS_PER_RUN + k) % len(names)
                for name in names[shift:] + names[:shift]:
                    try:
                        requests[name].append(await sides[name](number))
                    except (RuntimeError, OSError, ValueError, IndexError) as error:
                        raise RuntimeError(f"{LABELS[name]}: {error!r}") from error
                    number += 1
            if index == 0:
                continue
            for name in names:
                run = {key: statistics.median(r[key] for r in requests[name])
                       for key in requests[name][0]}
                run["requests"] = requests[name]
                samples[name].append(run)
            log(f"openai: run {index}/{runs} " + ", ".join(
                f"{name} {samples[name][-1]['decode_tok_s']:.1f} tok/s "
                f"{samples[name][-1]['first_token_ms']:.1f} ms" for name in names))
        return samples
    finally:
        for client in clients:
            await client.close()
        if stream is not None:
            await stream.close()
        if server is not None:
            server.stop()
        await daemon.stop()


ROWS = (  # key, label, unit
    ("decode_tok_s", "decode, client-side", "tok/s"),
    ("server_decode_tok_s", "decode, as the server reports it", "tok/s"),
    ("first_token_ms", "first token, client-side (send to first text)", "ms"),
    ("server_first_token_ms", "first token, server-side (daemon: arrival to first token; "
     "llama-server: prompt_ms)", "ms"),
    ("prompt_tokens", "prompt tokens", "tokens"),
    ("cached_tokens", "of them reused from the cache", "tokens"),
    ("tokens", "completion tokens", "tokens"),
)


def paired(samples: dict[str, list[dict[str, Any]]], top: str, bottom: str, key: str,
           combine: Callable[[float, float], float]) -> float:
    """Median over runs of combine(top, bottom), both measured in the same run."""
    values = [combine(a[key], b[key]) for a, b in zip(samples[top], samples[bottom], strict=True)]
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def targets(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    decode = paired(samples, "http", "ndjson", "decode_tok_s", lambda a, b: a / b)
    rows.append({"target": "endpoint decode >= 0.97 x NDJSON decode (paired ratio)",
                 "measured": decode, "met": decode >= 0.97})
    extra = paired(samples, "http", "ndjson", "first_token_ms", lambda a, b: a - b)
    rows.append({"target": "endpoint first token <= NDJSON first token + 2 ms (paired "
                           "difference, ms)", "measured": extra, "met": extra <= 2.0})
    if samples.get("llama-server"):
        ratio = paired(samples, "http", "llama-server", "first_token_ms", lambda a, b: a / b)
        rows.append({"target": "endpoint first token < llama-server's (paired ratio)",
                     "measured": ratio, "met": ratio < 1.0})
    return rows


def shown(stats: dict[str, float], unit: str) -> str:
    if math.isnan(stats["median"]):
        return "-"  # the daemon's HTTP replies carry no timings
    if unit == "tokens":
        return f"{stats['median']:.0f} ({stats['min']:.0f}-{stats['max']:.0f})"
    return cell(stats)


def print_table(samples: dict[str, list[dict[str, Any]]], header: str) -> list[dict[str, Any]]:
    names = [name for name in SIDES if samples.get(name)]
    print(f"OpenAI endpoint: {header}; speculation off everywhere, {PROMPTS_PER_RUN} cold "
          "prompts per side and run (a run's figure: their median)")
    print()
    print("| figure | unit | " + " | ".join(LABELS[name] for name in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for key, label, unit in ROWS:
        cells = [shown(summary([run[key] for run in samples[name]]), unit)
                 for name in names]
        print(f"| {label} | {unit} | " + " | ".join(cells) + " |")
    print()
    rows = targets(samples)
    print("| target | measured | met |")
    print("|---|---|---|")
    for row in rows:
        value = "nan" if math.isnan(row["measured"]) else f"{row['measured']:.3f}"
        print(f"| {row['target']} | {value} | {'yes' if row['met'] else 'NO'} |")
    return rows


def check(args: argparse.Namespace) -> list[str]:
    return peer_paths(llama_server=args.llama_server)


def run(bench: Bench) -> dict[str, Any]:
    """The section: measure, print the table and the targets; the JSON fields."""
    params, runs, llama_server, runner = (bench.params, bench.runs, bench.llama_server,
                                          bench.runner)
    header = bench.header
    log(f"[openai] daemon (NDJSON and HTTP){' and llama-server' if llama_server else ''}, "
        f"{runs} runs ...")
    samples = runner(measure(params, runs, llama_server))
    rows = print_table(samples, header)
    stats = {name: {key: summary([run[key] for run in runs_]) for key, _, _ in ROWS}
             for name, runs_ in samples.items()}
    return {"samples": samples, "stats": stats, "targets": rows}
