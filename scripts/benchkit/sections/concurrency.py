"""The concurrency section of scripts/bench.py: many clients at once (issue 9).

For 1, 2, 4 and 8 concurrent clients (one connection each, distinct prompts, `--tokens`
greedy tokens, no streaming), the aggregate rate is the completion tokens of all
clients divided by the time from the first send to the last reply. It is measured, in
each run and one right after the other, on:

- the daemon (started by bench.py; `--slots N` writes `[server] slots = N` into its config);
- llama-server (`--llama-server PATH` or LLAMA_SERVER), restarted for each row with
  `-np N` = the row's client count, `-c` = the daemon's n_ctx x N (llama-server divides
  `-c` among its slots), the daemon's threads, batch sizes and full-size SWA cache;
  requests go to its /completion endpoint;
- llama.cpp's `llama-batched-bench` (`--llama-batched-bench PATH` or LLAMA_BATCHED_BENCH):
  S_TG at B = 1, 2, 4, 8 for 32-token prompts, the ceiling batching can give.

And, on the daemon only:

- the first token of a short prompt sent while 3 other clients stream, against the same
  prompt on an idle daemon;
- the gaps between the token lines of a streaming client while another client's
  ~2000-token prompt is evaluated (p50/p99), and that prompt's first token.

The clients of those rows ask chat questions of the prompt corpus (benchkit/corpus,
`--corpus-split`, by default its held-out half), as chat turns in the model's template,
new ones for every row of every run (both servers get the row's same prompts);
`--corpus-split builtin` sends CLIENT_PROMPTS, raw openings, as before the corpus. The
warm-ups, the streaming clients and the probes keep their own prompts.

Run only this section with `scripts/bench.py concurrency`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchkit import corpus
from benchkit.common import SHORT_PROMPT, TIMEOUT_S, chat_turn_renderer, decode_reply, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream, fit_prompt
from benchkit.peers import BATCHED_CLIENTS, LlamaServer, peer_paths, run_batched_bench
from benchkit.table import cell, paired_ratio, print_targets, summary, targets_json

HELP = "1, 2, 4, 8 clients at once; first token and gaps under load (llama-server, batched-bench)"

CLIENT_COUNTS = BATCHED_CLIENTS  # llama-batched-bench's B: the same rows
CLIENT_PROMPTS = [  # distinct, so that no client reuses another's cached prefix
    "The history of the printing press begins",
    "A short guide to growing tomatoes:",
    "The main causes of the French Revolution were",
    "Here is a recipe for bread:",
    "The life cycle of a star starts when",
    "Ten tips for writing clear emails:",
    "The rules of chess are simple. First,",
    "A brief introduction to the Roman Empire:",
]
LOAD_STREAMERS = 3  # clients streaming while the short prompt arrives
SETTLE_S = 1.0  # longest wait for all of them to stream (a single slot serves one at a time)
IDLE_PROBES = 3  # the idle first-token value is the median of these
PROBE_TAGS = ("Amber", "Birch", "Cedar", "Delta")  # one per probe: no probe reuses another
LONG_PROMPT_TOKENS = 2000
GAP_STREAM_FACTOR = 4  # the streaming client's max_tokens, x --tokens: it must outlast the prefill
GAP_WARM_TOKENS = 32  # tokens streamed before the long prompt is sent


# --- the daemon ---------------------------------------------------------------------------


class ClientPrompts:
    """The rows' prompts: CLIENT_PROMPTS (`builtin`), or the chat questions of a corpus
    split as chat turns, each handed out once in the sitting while they last (then from
    the first again)."""

    def __init__(self, split: str, turn: Callable[[str], str] | None = None) -> None:
        self.split, self.turn, self.handed = split, turn, 0
        self.texts = [] if split == "builtin" else [
            prompt.text for prompt in corpus.load(["chat"], split)]
        if split != "builtin" and not self.texts:
            raise ValueError(f"the corpus's {split} split has no chat prompts")

    def take(self, clients: int) -> list[str]:
        if self.split == "builtin":
            return CLIENT_PROMPTS[:clients]
        assert self.turn is not None
        texts = [self.texts[(self.handed + i) % len(self.texts)] for i in range(clients)]
        self.handed += clients
        return [self.turn(text) for text in texts]

    def describe(self) -> str:
        if self.split == "builtin":
            return "built-in prompts"
        drawn = min(self.handed, len(self.texts))
        again = f", {self.handed - drawn} sent again" if self.handed > drawn else ""
        return (f"corpus split {self.split}: drew {drawn} of its {len(self.texts)} chat "
                f"prompts{again}")


async def daemon_aggregate(path: str, prompts: list[str], tokens: int) -> float:
    """Tokens/s of one request per prompt sent at once, one connection each, no
    streaming."""
    streams = [await Stream.open(path) for _ in prompts]

    async def one(stream: Stream, prompt: str) -> tuple[int, float]:
        run = await stream.figures({"prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                                    "stream": False})
        return run["tokens"], time.perf_counter()

    try:
        started = time.perf_counter()
        runs = await asyncio.gather(*(one(stream, prompt) for stream, prompt
                                      in zip(streams, prompts, strict=True)))
    finally:
        for stream in streams:
            await stream.close()
    return sum(n for n, _ in runs) / (max(t for _, t in runs) - started)


class Streamer:
    """A streaming client that stamps the arrival of every token line."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.stamps: list[float] = []
        self.sent = 0.0
        self.done: dict[str, Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self._wanted = 0
        self._reached = asyncio.Event()

    @classmethod
    async def start(cls, path: str, request: dict[str, Any]) -> Streamer:
        streamer = cls(await Stream.open(path))
        streamer.sent = time.perf_counter()
        streamer.stream.writer.write(json.dumps({**request, "stream": True}).encode() + b"\n")
        streamer.task = asyncio.create_task(streamer._read())
        return streamer

    async def _read(self) -> None:
        readline = self.stream.reader.readline
        while True:
            line = await readline()
            now = time.perf_counter()
            if not line:
                break
            reply = decode_reply(line)
            if reply["type"] == "token":
                self.stamps.append(now)
                if len(self.stamps) >= self._wanted:
                    self._reached.set()
            elif reply["type"] == "done":
                if not self.stamps:
                    self.stamps.append(now)
                self.done = reply
                break
            else:
                raise RuntimeError(f"daemon answered {reply}")
        self._reached.set()

    async def tokens(self, count: int, within_s: float = TIMEOUT_S) -> bool:
        """Wait until `count` tokens arrived (or the reply ended); False if not within_s."""
        self._wanted = count
        if len(self.stamps) >= count or self.done is not None:
            return True
        self._reached.clear()
        try:
            async with asyncio.timeout(within_s):
                await self._reached.wait()
        except TimeoutError:
            return False
        return True

    async def finish(self) -> None:
        assert self.task is not None
        async with asyncio.timeout(TIMEOUT_S):
            await self.task

    async def close(self) -> None:
        """Leave: a request still running is cancelled by the daemon."""
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await self.task
        await self.stream.close()


async def wait_idle(path: str) -> dict[str, Any]:
    """Until `health` shows nothing running or queued (after clients left mid-stream);
    the last health reply."""
    stream = await Stream.open(path)
    try:
        async with asyncio.timeout(TIMEOUT_S):
            while True:
                stream.writer.write(b'{"op": "health"}\n')
                reply = decode_reply(await stream.reader.readline())
                if not any(reply.get(key) for key in ("busy", "queue_depth", "slots_busy")):
                    return reply
                await asyncio.sleep(0.02)
    finally:
        await stream.close()


def fresh(prompt: str, tag: str) -> str:
    """The prompt behind a leading tag of its own: it shares no cached prefix (beyond BOS)
    with any other prompt of the bench. Cold requests (`cache_prompt: false`) are not used
    for that: the daemon may run them alone (exclusive), which would measure the queue."""
    return f"{tag}: {prompt}"


async def first_token_ms(path: str, prompt: str) -> float:
    stream = await Stream.open(path)
    try:
        run = await stream.generate(prompt, 1)
    finally:
        await stream.close()
    return float(run["first_token_ms"])


async def daemon_first_token_under_load(path: str, tokens: int) -> dict[str, Any]:
    """The short prompt's first token, idle and while LOAD_STREAMERS clients stream."""
    idle = statistics.median([await first_token_ms(path, fresh(SHORT_PROMPT, tag))
                              for tag in PROBE_TAGS[:IDLE_PROBES]])
    streamers = [await Streamer.start(path, {"prompt": prompt, "max_tokens": tokens,
                                             "temperature": 0.0})
                 for prompt in CLIENT_PROMPTS[:LOAD_STREAMERS]]
    try:
        deadline = time.perf_counter() + TIMEOUT_S
        await streamers[0].tokens(2, deadline - time.perf_counter())  # the first one runs
        settle = time.perf_counter() + SETTLE_S
        for streamer in streamers[1:]:
            await streamer.tokens(2, max(0.0, settle - time.perf_counter()))
        streaming = sum(1 for s in streamers if len(s.stamps) >= 2 and s.done is None)
        loaded = await first_token_ms(path, fresh(SHORT_PROMPT, PROBE_TAGS[IDLE_PROBES]))
    finally:
        for streamer in streamers:
            await streamer.close()
    await wait_idle(path)
    return {"first_token_idle_ms": idle, "first_token_loaded_ms": loaded,
            "first_token_loaded_streaming": streaming}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def daemon_gaps_under_prefill(path: str, long_prompt: str, tokens: int) -> dict[str, Any]:
    """A client streams; once it is in its stride another sends a long prompt. The
    streaming client's gaps between token lines, from that send until its first token
    after the long prompt's first token, and the long prompt's first token, against the
    same prompt alone."""
    alone = await first_token_ms(path, fresh(long_prompt, "Alone"))
    streamer = await Streamer.start(path, {"prompt": CLIENT_PROMPTS[-1], "temperature": 0.0,
                                           "max_tokens": GAP_STREAM_FACTOR * tokens})
    try:
        await streamer.tokens(GAP_WARM_TOKENS)
        before = [b - a for a, b in zip(streamer.stamps[1:], streamer.stamps[2:], strict=False)]
        long = await Stream.open(path)
        try:
            sent = time.perf_counter()
            run = await long.generate(fresh(long_prompt, "Beside"), 1)
        finally:
            await long.close()
        first = sent + run["first_token_ms"] / 1e3
        await streamer.tokens(sum(1 for t in streamer.stamps if t <= first) + 1)
        stamps = streamer.stamps
        outlasted = any(t > first for t in stamps)
        window = [i for i, t in enumerate(stamps) if t > sent and i > 0]
        if outlasted:
            window = [i for i in window if stamps[i - 1] <= first]
        gaps = [(stamps[i] - stamps[i - 1]) * 1e3 for i in window]
    finally:
        await streamer.close()
    await wait_idle(path)
    return {"gap_idle_p50_ms": percentile([g * 1e3 for g in before], 50),
            "gap_prefill_p50_ms": percentile(gaps, 50),
            "gap_prefill_p99_ms": percentile(gaps, 99),
            "gap_prefill_max_ms": max(gaps, default=float("nan")),
            "gap_prefill_count": len(gaps),
            "gap_stream_outlasted_prefill": outlasted,
            "long_prompt_tokens": run["prompt_tokens"],
            "long_first_token_alone_ms": alone,
            "long_first_token_beside_stream_ms": run["first_token_ms"]}


# --- one run ------------------------------------------------------------------------------


async def one_run(params: dict[str, Any], llama_server: str | None, batched_bench: str | None,
                  daemon_first: bool,
                  prompts: ClientPrompts | None = None) -> dict[str, dict[str, Any]]:
    """Every concurrency figure once, daemon and peers back to back; the rows' prompts
    from `prompts` (by default CLIENT_PROMPTS)."""
    prompts = prompts or ClientPrompts("builtin")
    result: dict[str, dict[str, Any]] = {"daemon": {}, "llama-server": {}, "batched-bench": {}}
    daemon = await Daemon.start(params)
    try:
        path = daemon.socket_path
        result["daemon"]["slots"] = (await wait_idle(path)).get("slots", 1)
        long_prompt = await fit_prompt(path, LONG_PROMPT_TOKENS - 4, seed=4)  # + a tag
        # A warm-up (first-touch pages of a first request).
        await daemon_aggregate(path, CLIENT_PROMPTS[:1], 8)
        for clients in CLIENT_COUNTS:
            key = f"clients_{clients}_tok_s"
            row = prompts.take(clients)

            async def measure_daemon(key: str = key, row: list[str] = row) -> None:
                result["daemon"][key] = await daemon_aggregate(path, row, params["tokens"])

            def measure_server(clients: int = clients, key: str = key,
                               row: list[str] = row) -> None:
                assert llama_server is not None
                server = LlamaServer.start(llama_server, params, clients)
                try:
                    server.completion(CLIENT_PROMPTS[-1], 8)  # warm-up, as for the daemon
                    result["llama-server"][key] = server.aggregate(row, params["tokens"])
                finally:
                    server.stop()

            if llama_server and not daemon_first:
                await asyncio.to_thread(measure_server)
            await measure_daemon()
            if llama_server and daemon_first:
                await asyncio.to_thread(measure_server)
            log(f"  {clients} clients: daemon {result['daemon'][key]:.1f} tok/s"
                + (f", llama-server -np {clients} {result['llama-server'][key]:.1f} tok/s"
                   if llama_server else ""))
        result["daemon"].update(await daemon_first_token_under_load(path, params["tokens"]))
        log(f"  first token: idle {result['daemon']['first_token_idle_ms']:.1f} ms, while "
            f"{LOAD_STREAMERS} stream {result['daemon']['first_token_loaded_ms']:.1f} ms")
        result["daemon"].update(await daemon_gaps_under_prefill(path, long_prompt,
                                                                params["tokens"]))
        log(f"  gaps while a {result['daemon']['long_prompt_tokens']}-token prompt is "
            f"evaluated: p50 {result['daemon']['gap_prefill_p50_ms']:.1f} ms, p99 "
            f"{result['daemon']['gap_prefill_p99_ms']:.1f} ms")
    finally:
        await daemon.stop()
    if batched_bench:
        s_tg = await asyncio.to_thread(run_batched_bench, batched_bench, params)
        result["batched-bench"] = {f"clients_{b}_tok_s": value for b, value in s_tg.items()}
        log("  llama-batched-bench S_TG: " + ", ".join(f"B={b} {v:.1f}" for b, v in s_tg.items()))
    return result


# --- the table ----------------------------------------------------------------------------


ROWS = [  # key, label, unit: daemon figures; the first four have peers
    *((f"clients_{n}_tok_s", f"{n} client{'s' if n > 1 else ''}, aggregate", "tok/s")
      for n in CLIENT_COUNTS),
    ("first_token_idle_ms", "first token, short prompt, idle", "ms"),
    ("first_token_loaded_ms",
     f"first token, short prompt, while {LOAD_STREAMERS} others stream", "ms"),
    ("gap_idle_p50_ms", "inter-token gap p50, one client alone", "ms"),
    ("gap_prefill_p50_ms", f"inter-token gap p50, while a {LONG_PROMPT_TOKENS}-token prompt "
                           "is evaluated", "ms"),
    ("gap_prefill_p99_ms", f"inter-token gap p99, while a {LONG_PROMPT_TOKENS}-token prompt "
                           "is evaluated", "ms"),
    ("long_first_token_alone_ms", f"first token, {LONG_PROMPT_TOKENS}-token prompt, alone",
     "ms"),
    ("long_first_token_beside_stream_ms",
     f"first token, {LONG_PROMPT_TOKENS}-token prompt, beside a streaming client", "ms"),
]


def stats_of(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    keys = {key for run in runs for key, value in run.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return {key: summary([float(run[key]) for run in runs if key in run]) for key in keys}


def targets(samples: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, bool]]:
    daemon = samples["daemon"]
    checks: list[tuple[str, float, float, bool]] = []
    if samples["batched-bench"]:
        checks.append(("4 clients >= 0.95 x llama-batched-bench S_TG (B=4)", paired_ratio(
            daemon, "clients_4_tok_s", samples["batched-bench"], "clients_4_tok_s"), 0.95, True))
    if samples["llama-server"]:
        checks.append(("4 clients >= 1.15 x llama-server -np 4", paired_ratio(
            daemon, "clients_4_tok_s", samples["llama-server"], "clients_4_tok_s"), 1.15, True))
    checks.append(("8 clients >= 2 x 1 client",
                   paired_ratio(daemon, "clients_8_tok_s", daemon, "clients_1_tok_s"), 2.0, True))
    checks.append((f"first token while {LOAD_STREAMERS} stream <= 2 x idle", paired_ratio(
        daemon, "first_token_loaded_ms", daemon, "first_token_idle_ms"), 2.0, False))
    return [(label, value, value >= limit if at_least else value <= limit)
            for label, value, limit, at_least in checks]


def print_table(samples: dict[str, list[dict[str, Any]]],
                header: str) -> list[tuple[str, float, bool]]:
    stats = {side: stats_of(runs) for side, runs in samples.items()}
    print(header)
    print()
    print("| figure | unit | sfcore daemon | llama-server (-np = clients) "
          "| llama-batched-bench S_TG (B = clients) | daemon/llama-server | "
          "daemon/batched-bench |")
    print("|---|---|---|---|---|---|---|")
    for key, label, unit in ROWS:
        cells = [cell(stats[side].get(key)) for side in ("daemon", "llama-server",
                                                         "batched-bench")]
        ratios = [f"{paired_ratio(samples['daemon'], key, samples[side], key):.3f}"
                  if key in stats[side] and key in stats["daemon"] else "-"
                  for side in ("llama-server", "batched-bench")]
        print(f"| {label} | {unit} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    print()
    slots = [run.get("slots") for run in samples["daemon"]]
    streaming = [run.get("first_token_loaded_streaming") for run in samples["daemon"]]
    outlasted = [run.get("gap_stream_outlasted_prefill") for run in samples["daemon"]]
    counts = [run.get("gap_prefill_count") for run in samples["daemon"]]
    print(f"Daemon slots (its health), per run: {slots}. "
          f"Clients streaming when the short prompt was sent, per run: {streaming} (of "
          f"{LOAD_STREAMERS}; waited at most {SETTLE_S:.0f} s for all). Gaps per run in the "
          f"long prompt's window: {counts}; the streaming client outlasted the long prompt's "
          f"prefill: {outlasted}.")
    checks = targets(samples)
    print_targets(checks)
    return checks


Samples = dict[str, list[dict[str, Any]]]


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--llama-batched-bench", default=os.environ.get("LLAMA_BATCHED_BENCH"),
                        help="path of llama.cpp's llama-batched-bench (default: "
                             "$LLAMA_BATCHED_BENCH)")
    parser.add_argument("--llama-server-kv", choices=("split", "unified"), default="split",
                        help="llama-server's KV cache: split (default): -c n_ctx x -np, "
                             "n_ctx cells for each slot; unified: -kvu -c n_ctx, one pool of "
                             "n_ctx cells shared by the slots, as in the daemon")


def check(args: argparse.Namespace) -> list[str]:
    return peer_paths(llama_server=args.llama_server,
                      llama_batched_bench=args.llama_batched_bench)


def measure(params: dict[str, Any], runs: int, llama_server: str | None,
            batched_bench: str | None, runner: Callable[[Any], Any], *,
            prompts: ClientPrompts | None = None) -> Samples:
    """All runs of the section; `runner` runs a coroutine to completion (uvloop.run);
    `prompts`: the rows' (by default CLIENT_PROMPTS)."""
    samples: dict[str, list[dict[str, Any]]] = {"daemon": [], "llama-server": [],
                                                "batched-bench": []}
    for index in range(runs):
        log(f"[run {index + 1}/{runs}] concurrency: daemon"
            + (f" (slots {params['slots']})" if params.get("slots") else "")
            + (", llama-server" if llama_server else "")
            + (", llama-batched-bench" if batched_bench else "") + " ...")
        result = runner(one_run(params, llama_server, batched_bench,
                                daemon_first=index % 2 == 1, prompts=prompts))
        for side, figures in result.items():
            if figures:
                samples[side].append(figures)
    return samples


def run(bench: Bench) -> dict[str, Any]:
    split = bench.args.corpus_split
    prompts = ClientPrompts(split, None if split == "builtin"
                            else chat_turn_renderer(bench.params["model"]))
    samples = measure(bench.params, bench.runs, bench.llama_server,
                      bench.args.llama_batched_bench, bench.runner, prompts=prompts)
    checks = print_table(samples, f"Concurrent clients: {bench.header}; llama-server -np = "
                                  f"clients, KV {bench.params['llama_server_kv']}; "
                                  f"{prompts.describe()}")
    return {"samples": samples, "prompts": {"split": split, "sent": prompts.handed},
            "stats": {side: stats_of(runs) for side, runs in samples.items()},
            "targets": targets_json(checks)}
