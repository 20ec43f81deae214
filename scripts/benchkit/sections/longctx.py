"""Long prompts on any model: the first token and the decode rate after it for prompts of
about 2k, 8k and 16k tokens and the largest the daemon's context holds, the daemon against
llama-server, both at their own default settings, with llama-bench as the ceiling.

- The daemon: its defaults and the bench's threads (`[model] n_ctx = 0`: the context is
  sized from the model; `--n-ctx N` sets it instead), timed through its socket.
- llama-server (`--llama-server PATH` or LLAMA_SERVER): its defaults and the same threads
  (no `-c`, `-np`, `-b`, `-ub` or `--swa-full`), streamed `/completion` with
  `cache_prompt: false`.
- llama-bench (`--llama-bench PATH` or LLAMA_BENCH): `pp<N>` (an N-token prompt into an
  empty context, the work a cold prompt is) and `tg<tokens>` at depth N (`-d N`), one
  repetition each, no warm-up run.

`--sizes` lists the prompts' sizes in tokens; `max` is the daemon's n_ctx (from its `info`)
less the generated tokens and `MARGIN`; a size above that is skipped. Every round has a
fresh prompt for every size: filler words of a seed of its own, cut by the daemon's
tokenizer to at most the size, the same text to every side within the round, so no cache
of any side has seen it. Greedy, `--tokens` generated tokens (default 64).

Only one llama.cpp process runs at a time: for each size of each round, each side in turn
starts fresh and alone, answers one unmeasured short prompt (first-touch costs), answers
the measured one and stops; the sides' order rotates by round and size. A round's ratio is
daemon / other on that round's figures; the table shows the median of those. A prompt a
server answers with an error (too long for its context) is shown as refused.

First token: client-side, from writing the request to the first token's line or event, for
both servers; prefill tok/s is the prompt's tokens over it. Decode: (generated tokens - 1)
over the time from the first token to the last. Each server's own prompt time (the
daemon's `timings.prompt_ms`, llama-server's `timings.prompt_ms`) is shown beside it.

    .venv/bin/python scripts/bench.py longctx [--sizes 2000,8000,16000,max] [--runs 3]
        [--tokens 64] [--model PATH] [--llama-server PATH] [--llama-bench PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
from collections.abc import Callable
from typing import Any

from benchkit.common import TIMEOUT_S, filler_text, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream, fit_prompt
from benchkit.peers import LlamaServer, peer_paths
from benchkit.sections.openai import HttpChat
from benchkit.table import cell, print_head, row, summary

HELP = ("long prompts (about 2k, 8k, 16k tokens, the context's largest): first token and "
        "decode, daemon against llama-server (both at their defaults) and llama-bench")
DEFAULTS = {"runs": 3, "tokens": 64, "n_ctx": 0}
DEFAULT_SIZES = "2000,8000,16000,max"
# Tokens kept free below the daemon's n_ctx for the `max` size, besides the generated ones.
MARGIN = 32
WARM_UP_WORDS = 300
SIDES = ("daemon", "llama-server", "llama-bench")
SERVERS = ("daemon", "llama-server")


class Refused(Exception):
    """A server answered the prompt with an error (too long for its context)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="longctx: prompt sizes in tokens, `max` for the largest the "
                             f"daemon's context holds (default {DEFAULT_SIZES})")


def parse_sizes(text: str) -> list[int | str]:
    sizes: list[int | str] = []
    for raw in text.split(","):
        part = raw.strip().lower()
        if part == "max":
            sizes.append("max")
        elif part.isdigit() and int(part) >= 16:
            sizes.append(int(part))
        else:
            raise ValueError(f"--sizes: {part!r} is neither a size of at least 16 nor max")
    return sizes


def check(args: argparse.Namespace) -> list[str]:
    problems = peer_paths(llama_server=args.llama_server, llama_bench=args.llama_bench)
    try:
        parse_sizes(args.sizes)
    except ValueError as error:
        problems.append(str(error))
    return problems


def hang_bound(size: int) -> float:
    """The longest wait for one prompt's reply: a hang bound, generous on a busy machine."""
    return TIMEOUT_S + size / 20


class HttpCompletion(HttpChat):
    """HttpChat's HTTP/1.1 client, streaming llama-server's `/completion`; a connection
    of its own for every request (llama-server closes it after a streamed reply)."""

    async def complete(self, body: dict[str, Any], bound_s: float) -> dict[str, Any]:
        reader, started = await self._post("/completion", body)
        arrivals: list[float] = []
        final: dict[str, Any] = {}
        async with asyncio.timeout(bound_s):
            status, headers = await self._head(reader)
            if status != 200:
                text = await self._whole(reader, headers)
                await self.close()
                raise Refused(f"HTTP {status}: {text[:300]!r}")
            async for now, data in self._events(reader, headers):
                event = json.loads(data)
                if "error" in event:
                    await self.close()
                    raise Refused(f"{event['error']!r}"[:300])
                if event.get("stop"):
                    final = event
                else:
                    arrivals.append(now)
        await self._done_with(headers, close=True)
        if not final or not arrivals:
            raise RuntimeError(f"llama-server's stream ended without a token or its end: "
                               f"{final!r}"[:300])
        timings = final.get("timings") or {}
        tokens = int(timings.get("predicted_n", len(arrivals)))
        return figures(started, arrivals[0], arrivals[-1], tokens,
                       prompt_tokens=int(timings.get("prompt_n",
                                                     final.get("tokens_evaluated", 0))),
                       server_prompt_ms=float(timings.get("prompt_ms", math.nan)))


def figures(started: float, first: float, last: float, tokens: int, *, prompt_tokens: int,
            server_prompt_ms: float) -> dict[str, Any]:
    first_ms = (first - started) * 1e3
    return {"first_token_ms": first_ms,
            "prefill_tok_s": prompt_tokens / (first_ms / 1e3) if first_ms > 0 else math.nan,
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first
            else math.nan,
            "tokens": tokens, "prompt_tokens": prompt_tokens,
            "server_prompt_ms": server_prompt_ms}


async def daemon_prompt(stream: Stream, prompt: str, tokens: int, bound_s: float
                        ) -> dict[str, Any]:
    timed = await stream.timed({"prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                                "cache_prompt": False}, bound_s)
    done = timed.final
    if done["type"] == "error":
        raise Refused(f"{done.get('code')}: {done.get('message')}"[:300])
    if done["type"] != "done":
        raise RuntimeError(f"daemon answered {done}")
    usage = done["usage"]
    return figures(timed.started, timed.first, timed.last, usage["completion_tokens"],
                   prompt_tokens=usage["prompt_tokens"],
                   server_prompt_ms=float(done["timings"]["prompt_ms"]))


async def on_daemon(params: dict[str, Any], prompt: str, warm_up: str, bound_s: float
                    ) -> dict[str, Any]:
    daemon = await Daemon.start(params)
    try:
        stream = await Stream.open(daemon.socket_path)
        try:
            await daemon_prompt(stream, warm_up, 1, TIMEOUT_S)
            return await daemon_prompt(stream, prompt, params["tokens"], bound_s)
        finally:
            await stream.close()
    finally:
        await daemon.stop()


async def on_llama_server(binary: str, params: dict[str, Any], prompt: str, warm_up: str,
                          bound_s: float) -> dict[str, Any]:
    server = await asyncio.to_thread(LlamaServer.start, binary,
                                     {**params, "llama_server_kv": "default"}, 1)
    client = HttpCompletion("127.0.0.1", server.port)
    try:
        body = {"n_predict": 1, "stream": True, "cache_prompt": False, "temperature": 0.0,
                "top_k": 1}
        await client.complete({**body, "prompt": warm_up}, TIMEOUT_S)
        return await client.complete({**body, "prompt": prompt,
                                      "n_predict": params["tokens"]}, bound_s)
    finally:
        await client.close()
        await asyncio.to_thread(server.stop)


def llama_bench(binary: str, params: dict[str, Any], size: int, bound_s: float
                ) -> dict[str, Any]:
    """pp<size> into an empty context and tg<tokens> at depth size, one process each."""
    result: dict[str, Any] = {}
    for key, extra in (("prefill_tok_s", ["-p", str(size), "-n", "0"]),
                       ("decode_tok_s", ["-p", "0", "-n", str(params["tokens"]),
                                         "-d", str(size)])):
        out = subprocess.run([binary, "-m", params["model"], "-t", str(params["n_threads"]),
                              *extra, "-r", "1", "--no-warmup", "-o", "json"],
                             capture_output=True, text=True, check=False, timeout=bound_s)
        if out.returncode != 0:
            raise Refused(f"llama-bench exited with {out.returncode}: {out.stderr[-300:]}")
        result[key] = float(json.loads(out.stdout)[0]["avg_ts"])
    return result


async def setup(params: dict[str, Any], specs: list[int | str], runs: int
                ) -> tuple[int, list[int], list[int], list[dict[int, str]]]:
    """From a daemon of its own: its n_ctx, the sizes run and skipped, and every round's
    prompt for every size."""
    daemon = await Daemon.start(params)
    try:
        stream = await Stream.open(daemon.socket_path)
        try:
            info = await stream.final({"op": "info"}, TIMEOUT_S)
        finally:
            await stream.close()
        n_ctx = int(info["config"]["n_ctx"])
        limit = n_ctx - params["tokens"] - MARGIN
        wanted = sorted({limit if spec == "max" else int(spec) for spec in specs})
        sizes = [size for size in wanted if 16 <= size <= limit]
        skipped = [size for size in wanted if size not in sizes]
        prompts: list[dict[int, str]] = []
        for index in range(runs):
            prompts.append({size: await fit_prompt(daemon.socket_path, size,
                                                   1000 * (index + 1) + number)
                            for number, size in enumerate(sizes)})
    finally:
        await daemon.stop()
    return n_ctx, sizes, skipped, prompts


def measure(bench: Bench, params: dict[str, Any], sizes: list[int],
            prompts: list[dict[int, str]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Per size, per side, per round: its figures, or {"refused": why}."""
    server_path = bench.llama_server
    bench_path = bench.args.llama_bench
    warm_up = filler_text(WARM_UP_WORDS, 1)
    sides: dict[str, Callable[[int, str], Any]] = {
        "daemon": lambda size, prompt: bench.runner(
            on_daemon(params, prompt, warm_up, hang_bound(size)))}
    if server_path:
        sides["llama-server"] = lambda size, prompt: bench.runner(
            on_llama_server(server_path, params, prompt, warm_up, hang_bound(size)))
    if bench_path:
        sides["llama-bench"] = lambda size, _: llama_bench(bench_path, params, size,
                                                           4 * hang_bound(size))
    names = list(sides)
    samples: dict[int, dict[str, list[dict[str, Any]]]] = {
        size: {name: [] for name in names} for size in sizes}
    for index, prompt_of in enumerate(prompts):
        for number, size in enumerate(sizes):
            shift = (index + number) % len(names)
            for name in names[shift:] + names[:shift]:
                try:
                    result = sides[name](size, prompt_of[size])
                except Refused as error:
                    result = {"refused": str(error)}
                samples[size][name].append(result)
                shown = (f"refused ({result['refused']})" if "refused" in result else
                         ", ".join(f"{key} {value:.1f}" for key, value in result.items()
                                   if key.endswith(("_ms", "_tok_s"))))
                log(f"[longctx] round {index + 1}/{len(prompts)}, {size} tokens, "
                    f"{name}: {shown}")
    return samples


def stats_cell(runs: list[dict[str, Any]], key: str) -> str:
    if not runs:
        return "-"
    values = [run[key] for run in runs if key in run]
    refused = sum("refused" in run for run in runs)
    if not values:
        return "refused" if refused else "-"
    shown = cell(summary(values))
    return f"{shown}, refused {refused}/{len(runs)}" if refused else shown


def ratio(top: list[dict[str, Any]], bottom: list[dict[str, Any]], key: str,
          bottom_key: str | None = None) -> float:
    """The median over rounds of top / bottom, of the rounds where both answered."""
    values = [a[key] / b[bottom_key or key] for a, b in zip(top, bottom, strict=False)
              if key in a and (bottom_key or key) in b and b[bottom_key or key]
              and not math.isnan(a[key] / b[bottom_key or key])]
    return statistics.median(values) if values else math.nan


def shown_ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def print_table(samples: dict[int, dict[str, list[dict[str, Any]]]], n_ctx: int,
                skipped: list[int], tokens: int, header: str) -> dict[str, dict[str, float]]:
    print(f"Long prompts: daemon (its defaults, n_ctx {n_ctx} from `info`) against "
          f"llama-server (its defaults) and llama-bench, greedy, {tokens} generated tokens: "
          f"{header}")
    if skipped:
        print(f"\nSkipped (above n_ctx {n_ctx} less {tokens} generated and {MARGIN} spare "
              f"tokens): {', '.join(map(str, skipped))}")
    print("\nRatios: daemon / the other side, the median of the rounds' ratios (ms: below 1 "
          "is better; tok/s: above 1 is better). llama-bench: pp<N> for prefill, tg at "
          "depth N for decode.\n")
    print_head("prompt", "figure", "unit", "daemon", "llama-server", "daemon/llama-server",
               "llama-bench", "daemon/llama-bench")
    rows = (("first_token_ms", "first token (client side)", "ms", False),
            ("prefill_tok_s", "prefill (prompt tokens / first token)", "tok/s", True),
            ("decode_tok_s", "decode after the first token", "tok/s", True),
            ("server_prompt_ms", "the server's own prompt time", "ms", False))
    ratios: dict[str, dict[str, float]] = {}
    for size, sides in samples.items():
        daemon = sides["daemon"]
        server = sides.get("llama-server", [])
        ceiling = sides.get("llama-bench", [])
        counted = [run["prompt_tokens"] for run in daemon if "prompt_tokens" in run]
        label = f"{size} ({statistics.median(counted):.0f} tokens)" if counted else str(size)
        ratios[str(size)] = {}
        for key, text, unit, has_ceiling in rows:
            versus_server = ratio(daemon, server, key)
            versus_ceiling = ratio(daemon, ceiling, key) if has_ceiling else math.nan
            ratios[str(size)][f"{key}_vs_llama_server"] = versus_server
            if has_ceiling:
                ratios[str(size)][f"{key}_vs_llama_bench"] = versus_ceiling
            print(row(label, text, unit, stats_cell(daemon, key), stats_cell(server, key),
                      shown_ratio(versus_server),
                      stats_cell(ceiling, key) if has_ceiling else "-",
                      shown_ratio(versus_ceiling)))
    return ratios


def run(bench: Bench) -> dict[str, Any]:
    """The section: prompts fitted, every round measured, the table; the JSON fields."""
    args = bench.args
    params = {**bench.params, "tokens": args.tokens}
    specs = parse_sizes(args.sizes)
    peers = [name for name, path in (("llama-server", bench.llama_server),
                                     ("llama-bench", args.llama_bench)) if path]
    log(f"[longctx] daemon{''.join(' and ' + name for name in peers)}, sizes {args.sizes}, "
        f"{bench.runs} rounds ...")
    n_ctx, sizes, skipped, prompts = bench.runner(setup(params, specs, bench.runs))
    if not sizes:
        raise RuntimeError(f"no size of {args.sizes} fits the daemon's n_ctx {n_ctx}")
    samples = measure(bench, params, sizes, prompts)
    ratios = print_table(samples, n_ctx, skipped, args.tokens, bench.header)
    return {"n_ctx": n_ctx, "sizes": sizes, "skipped": skipped, "ratios": ratios,
            "samples": {str(size): sides for size, sides in samples.items()}}
