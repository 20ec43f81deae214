"""Per-token cost of the client's reading path, without the daemon or a model.

A thread serves a Unix socket from memory: to the first request line it answers with
N `token` lines (recorded from the real daemon: token_lines.ndjson, repeated) and a
`done` line, all at once. The clock runs from the first piece the caller gets to the
end of the stream, through the real code: `Client.stream_generate` and
`AsyncClient.stream_generate` (socket reads, line splitting, json.loads, routing,
the stream's iteration). The floor is json.loads alone over the same lines.

    python clients/python/benchmarks/parse_tokens.py [--tokens 100000] [--runs 5]

Prints microseconds per token, median of the runs (min-max): wall time, and the CPU
time of the reading thread alone (time.thread_time), which a busy machine disturbs less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from sfcore_client import AsyncClient, Client

RECORDED = Path(__file__).with_name("token_lines.ndjson")
DONE = (b'{"type":"done","id":%s,"text":"","finish_reason":"length","stop_sequence":null,'
        b'"usage":{"prompt_tokens":17,"cached_tokens":1,"completion_tokens":%d},'
        b'"timings":{"queued_ms":0.7,"prompt_ms":31.8,"prompt_tok_s":500.0,'
        b'"first_token_ms":33.0,"decode_ms":1500.0,"decode_tok_s":64.0,"total_ms":1533.0}}\n')


def token_lines(count: int) -> list[bytes]:
    recorded = RECORDED.read_bytes().splitlines(keepends=True)
    return [recorded[i % len(recorded)] for i in range(count)]


class Server:
    """Answers each connection's requests from memory, with the request's own id."""

    def __init__(self, lines: list[bytes]) -> None:
        self.template = b"".join(lines)
        self.count = len(lines)
        self.directory = tempfile.TemporaryDirectory(prefix="sfb", dir="/tmp")
        self.path = str(Path(self.directory.name) / "s.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as requests:
            for line in requests:
                request_id = json.dumps(json.loads(line)["id"]).encode()
                body = self.template.replace(b'"id":1,', b'"id":' + request_id + b",")
                try:
                    conn.sendall(body + DONE % (request_id, self.count))
                except OSError:
                    return

    def close(self) -> None:
        self.listener.close()
        self.directory.cleanup()


Figure = tuple[float, float]  # (wall, thread CPU) microseconds per token


def _clock() -> Figure:
    return time.perf_counter(), time.thread_time()


def _per_token(start: Figure, count: int) -> Figure:
    wall, cpu = _clock()
    return (wall - start[0]) / count * 1e6, (cpu - start[1]) / count * 1e6


def blocking_run(path: str, count: int) -> Figure:
    with Client(path, timeout=60) as client:
        stream = client.stream_generate("x")
        pieces = iter(stream)
        next(pieces)
        start = _clock()
        for _ in pieces:
            pass
        figure = _per_token(start, count - 1)
        assert stream.result is not None and stream.result.usage.completion_tokens == count
    return figure


async def async_run(path: str, count: int) -> Figure:
    async with AsyncClient(path, timeout=60) as client:
        stream = client.stream_generate("x")
        pieces = aiter(stream)
        await anext(pieces)
        start = _clock()
        async for _ in pieces:
            pass
        figure = _per_token(start, count - 1)
        assert stream.result is not None and stream.result.usage.completion_tokens == count
    return figure


def loads_floor(lines: list[bytes]) -> Figure:
    loads = json.loads
    start = _clock()
    for line in lines:
        loads(line)
    return _per_token(start, len(lines))


def measure(count: int = 100_000, runs: int = 5) -> dict[str, list[Figure]]:
    """(wall, thread CPU) µs per token of each path, one figure per run."""
    lines = token_lines(count)
    server = Server(lines)
    try:
        figures: dict[str, list[Figure]] = {"Client": [], "AsyncClient": [],
                                            "json.loads only": []}
        for _ in range(runs):
            figures["Client"].append(blocking_run(server.path, count))
            figures["AsyncClient"].append(asyncio.run(async_run(server.path, count)))
            figures["json.loads only"].append(loads_floor(lines))
        return figures
    finally:
        server.close()


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"us/token, median (min-max) of {args.runs} runs of {args.tokens} tokens")
    print(f"{'':16} {'wall':18} thread CPU")
    for name, values in measure(args.tokens, args.runs).items():
        print(f"{name:16} {_summary([wall for wall, _ in values]):18} "
              f"{_summary([cpu for _, cpu in values])}")


if __name__ == "__main__":
    main()
