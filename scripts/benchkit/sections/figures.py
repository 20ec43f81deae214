"""The daemon against the llama.cpp ceiling, measured side by side in one run.

Each run starts fresh processes on the same model, threads and prompts:

- the ceiling: llama.cpp driven in a process of its own through llama-cpp-python's
  low-level C API and llama.cpp's C sampler chain, with the daemon's context settings
  (benchkit/ceiling.py);
- the daemon, through its Unix socket, timed as a client sees it;
- a peer for reference: llama-cpp-python's high-level `Llama` (decode and first token),
  unless --no-peer.

The ceiling and the daemon are up together, idle but for the one being measured, and
each figure is taken on one right after the other (who goes first alternates by run),
so a noisy moment on a shared machine hits both sides, not one.

With `--llama-bench PATH` (or LLAMA_BENCH=PATH) llama.cpp's own `llama-bench` runs too.
Every figure is the median of --runs runs, shown with its min-max; ratios are the
median of the per-run ratios (each pair measured back to back). Both sides first
evaluate one unmeasured long prompt: the first 512-token batch after start also pays
~25 MB of first-touch page faults in llama.cpp's compute buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

from benchkit.ceiling import PREFILL_TOKENS, PREFIX_TOKENS, Ceiling
from benchkit.common import SHORT_PROMPT, filler_text, log, peak_rss_mb
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.peers import run_llama_bench, run_peer
from benchkit.table import cell, paired_ratio, print_targets, summary, targets_json

HELP = "one client: decode, prefill, first token, start-up, RSS against the C API ceiling"
DECODE_PROMPT = "The history of the printing press begins"
CONCURRENT_PROMPTS = [
    "The history of the printing press begins",
    "A short guide to growing tomatoes:",
    "The main causes of the French Revolution were",
    "Here is a recipe for bread:",
]
QUESTIONS = ("\n\nQuestion: what is the first topic above?\nAnswer:",
             "\n\nQuestion: summarise the text above in one line.\nAnswer:")
RSS_HEADROOM_MB = 100.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                        help="path of llama.cpp's llama-bench (default: $LLAMA_BENCH)")


Side = Any  # a Ceiling or a Stream: both have generate(text, tokens, sampled, cache)


Step = Callable[[Side], Coroutine[Any, Any, dict[str, Any]]]


def figure_steps(tokens: int, prompts: dict[str, str]) -> list[Step]:
    """The figures both sides have; each step leaves nothing behind that the next needs."""
    prompt_a, prompt_b = (prompts["prefix"] + question for question in QUESTIONS)

    async def decode(side: Side) -> dict[str, Any]:
        run = await side.generate(DECODE_PROMPT, tokens)
        return {"decode_tok_s": run["decode_tok_s"], "decode_tokens": run["tokens"]}

    async def sampled(side: Side) -> dict[str, Any]:
        run = await side.generate(DECODE_PROMPT, tokens, sampled=True)
        return {"sampled_tok_s": run["decode_tok_s"], "sampled_tokens": run["tokens"]}

    async def prefill(side: Side) -> dict[str, Any]:
        run = await side.generate(prompts["prefill"], 1, cache=False)
        return {"prefill_tok_s": run["prompt_tokens"] / (run["first_token_ms"] / 1e3)}

    async def short(side: Side) -> dict[str, Any]:
        run = await side.generate(SHORT_PROMPT, 1, cache=False)
        return {"first_token_short_ms": run["first_token_ms"]}

    async def prefix(side: Side) -> dict[str, Any]:
        cold = await side.generate(prompt_b, 1, cache=False)
        await side.generate(prompt_a, 1)
        cached = await side.generate(prompt_b, 1)
        return {"first_token_prefix_cold_ms": cold["first_token_ms"],
                "first_token_prefix_cached_ms": cached["first_token_ms"],
                "prefix_cached_tokens": cached["cached_tokens"]}

    return [decode, sampled, prefill, short, prefix]


async def measure_concurrency(path: str, tokens: int) -> dict[str, float]:
    """One client alone, then four at once, on the same prompts, end to end."""

    async def one(prompt: str) -> tuple[int, float]:
        client = await Stream.open(path)
        run = await client.generate(prompt, tokens)
        await client.close()
        return run["tokens"], time.perf_counter()

    started = time.perf_counter()
    n_single, finished = await one(CONCURRENT_PROMPTS[1])
    single = n_single / (finished - started)
    started = time.perf_counter()
    runs = await asyncio.gather(*(one(prompt) for prompt in CONCURRENT_PROMPTS))
    aggregate = sum(n for n, _ in runs) / (max(t for _, t in runs) - started)
    return {"single_client_tok_s": single, "concurrent_4_tok_s": aggregate}


async def one_run(params: dict[str, Any], daemon_first: bool) -> tuple[dict[str, Any],
                                                                        dict[str, Any]]:
    """Both sides up at once and measured figure by figure, one right after the other,
    so that a noisy moment on the machine hits both; who goes first alternates.

    Start-up is timed with each side alone: here a process loading the model while
    another one has it mapped took 200-250 ms longer (medians of 6: 875-953 ms
    against 663-720 ms), whichever process it was."""
    ready_ms = {}
    for name in ("daemon", "ceiling") if daemon_first else ("ceiling", "daemon"):
        alone = await (Daemon if name == "daemon" else Ceiling).start(params)
        ready_ms[name] = alone.ready_ms
        await alone.stop()
    ceiling = await Ceiling.start(params)
    daemon = await Daemon.start(params)
    stream = await Stream.open(daemon.socket_path)
    try:
        prompts = await ceiling.call("prompts")
        warm_up = filler_text(PREFILL_TOKENS, seed=3)
        sides: list[tuple[str, Side]] = [("ceiling", ceiling), ("daemon", stream)]
        if daemon_first:
            sides.reverse()
        results: dict[str, dict[str, Any]] = {"ceiling": {}, "daemon": {}}
        for _, side in sides:
            await side.generate(warm_up, 1)
        decode, sampled, *others = figure_steps(params["tokens"], prompts)
        # The decode figures twice, in A-B-B-A order, each run's value the mean of the
        # two: the target ratios (0.97, 0.95) are finer than this machine's noise.
        twice: dict[str, dict[str, list[float]]] = {"ceiling": {}, "daemon": {}}
        for order in (sides, sides[::-1]):
            for step in (decode, sampled):
                for name, side in order:
                    for key, value in (await step(side)).items():
                        twice[name].setdefault(key, []).append(value)
        for name, figures in twice.items():
            results[name].update({key: statistics.fmean(values)
                                  for key, values in figures.items()})
        for step in others:
            for name, side in sides:
                results[name].update(await step(side))
        for name, figures in results.items():
            log(f"  {name}: decode {figures['decode_tok_s']:.1f} tok/s, prefill "
                f"{figures['prefill_tok_s']:.1f} tok/s, first token "
                f"{figures['first_token_short_ms']:.1f} ms")
        results["daemon"].update(await measure_concurrency(daemon.socket_path,
                                                           params["tokens"]))
        results["ceiling"].update(await ceiling.call("rss"))
        results["daemon"]["peak_rss_mb"] = peak_rss_mb(daemon.process.pid)
        for name, value in ready_ms.items():
            results[name]["ready_ms"] = value
    finally:
        await stream.close()
        await daemon.stop()
        await ceiling.stop()
    return results["ceiling"], results["daemon"]


ROWS = [  # key, label, unit
    ("decode_tok_s", "decode, greedy", "tok/s"),
    ("sampled_tok_s", "decode, sampled", "tok/s"),
    ("prefill_tok_s", f"prefill, {PREFILL_TOKENS}-token prompt", "tok/s"),
    ("first_token_short_ms", "first token, short cold prompt", "ms"),
    ("first_token_prefix_cold_ms", f"first token, {PREFIX_TOKENS}-token prompt, cold", "ms"),
    ("first_token_prefix_cached_ms", f"first token, same, {PREFIX_TOKENS}-token prefix cached",
     "ms"),
    ("ready_ms", "process start to ready", "ms"),
    ("single_client_tok_s", "1 client, end to end", "tok/s"),
    ("concurrent_4_tok_s", "4 concurrent clients, aggregate", "tok/s"),
    ("peak_rss_mb", "peak RSS", "MB"),
]


def targets(samples: dict[str, list[dict[str, Any]]], medians: dict[str, dict[str, float]],
            bound_mb: float) -> list[tuple[str, float, bool]]:
    daemon, ceiling = samples["daemon"], samples["ceiling"]
    checks = [
        ("decode >= 0.97 x ceiling",
         paired_ratio(daemon, "decode_tok_s", ceiling, "decode_tok_s"), 0.97, True),
        ("prefill >= 0.95 x ceiling",
         paired_ratio(daemon, "prefill_tok_s", ceiling, "prefill_tok_s"), 0.95, True),
        ("sampled >= 0.95 x greedy",
         paired_ratio(daemon, "sampled_tok_s", daemon, "decode_tok_s"), 0.95, True),
        ("first token, short cold <= 60 ms", medians["daemon"]["first_token_short_ms"], 60.0,
         False),
        ("cached prefix <= 1/10 of cold", paired_ratio(
            daemon, "first_token_prefix_cached_ms", daemon, "first_token_prefix_cold_ms"),
         0.1, False),
        ("ready <= 800 ms", medians["daemon"]["ready_ms"], 800.0, False),
        ("4 clients >= 0.95 x 1 client",
         paired_ratio(daemon, "concurrent_4_tok_s", daemon, "single_client_tok_s"), 0.95, True),
        (f"peak RSS <= {bound_mb:.0f} MB (model + KV + {RSS_HEADROOM_MB:.0f})",
         medians["daemon"]["peak_rss_mb"], bound_mb, False),
    ]
    if samples["llama-bench"]:
        checks.append(("decode >= 0.95 x llama-bench tg", paired_ratio(
            daemon, "decode_tok_s", samples["llama-bench"], "decode_tok_s"), 0.95, True))
    return [(label, value, value >= limit if at_least else value <= limit)
            for label, value, limit, at_least in checks]


def print_table(samples: dict[str, list[dict[str, Any]]],
                stats: dict[str, dict[str, dict[str, float]]],
                checks: list[tuple[str, float, bool]],
                header: str) -> None:
    print(header)
    print()
    print("| figure | unit | ceiling (C API, own process) | sfcore daemon (socket) "
          "| daemon/ceiling (paired) | llama-cpp-python Llama |")
    print("|---|---|---|---|---|---|")
    for key, label, unit in ROWS:
        ceiling, daemon, peer = (stats[side].get(key) for side in ("ceiling", "daemon", "peer"))
        ratio = (f"{paired_ratio(samples['daemon'], key, samples['ceiling'], key):.3f}"
                 if ceiling and daemon else "-")
        print(f"| {label} | {unit} | {cell(ceiling)} | {cell(daemon)} | {ratio} | {cell(peer)} |")
    if samples["llama-bench"]:
        for key, label in (("decode_tok_s", "llama-bench tg"), ("prefill_tok_s", "llama-bench pp")):
            paired = paired_ratio(samples["daemon"], key, samples["llama-bench"], key)
            print(f"| {label}{params_note(key)} | tok/s | {cell(stats['llama-bench'][key])} | "
                  f"{cell(stats['daemon'][key])} | {paired:.3f} | - |")
    print_targets(checks)


def params_note(key: str) -> str:
    return f" ({PREFILL_TOKENS})" if key == "prefill_tok_s" else ""


def run(bench: Bench) -> dict[str, Any]:
    """The single-client figures: every run, the table, the targets; the JSON fields."""
    args, params, header = bench.args, bench.params, bench.header
    model = params["model"]
    samples: dict[str, list[dict[str, Any]]] = {
        "ceiling": [], "daemon": [], "peer": [], "llama-bench": []}
    for index in range(args.runs):
        log(f"[run {index + 1}/{args.runs}] ceiling (C API, own process) and daemon (socket) ...")
        ceiling, daemon = bench.runner(one_run(params, daemon_first=index % 2 == 1))
        samples["ceiling"].append(ceiling)
        samples["daemon"].append(daemon)
        log(f"  ready: ceiling {ceiling['ready_ms']:.0f} ms, daemon {daemon['ready_ms']:.0f} ms; "
            f"1 client {daemon['single_client_tok_s']:.1f} tok/s, 4 clients "
            f"{daemon['concurrent_4_tok_s']:.1f} tok/s")
        if args.llama_bench:
            log(f"[run {index + 1}/{args.runs}] llama-bench ...")
            samples["llama-bench"].append(run_llama_bench(args.llama_bench, params,
                                                         PREFILL_TOKENS))
            log(f"  tg {samples['llama-bench'][-1]['decode_tok_s']:.1f} tok/s")
        if not args.no_peer:
            log(f"[run {index + 1}/{args.runs}] llama-cpp-python Llama ...")
            peer = run_peer(params, DECODE_PROMPT)
            samples["peer"].append(peer)
            log(f"  decode {peer['decode_tok_s']:.1f} tok/s")
    keys = [key for key, _, _ in ROWS]
    stats = {side: {key: summary([run[key] for run in runs])
                    for key in keys if runs and key in runs[0]}
             for side, runs in samples.items()}
    kv_mb = samples["ceiling"][0]["kv_mib"] * 1.048576
    bound_mb = os.path.getsize(model) / 1e6 + kv_mb + RSS_HEADROOM_MB
    medians = {side: {key: value["median"] for key, value in figures.items()}
               for side, figures in stats.items()}
    checks = targets(samples, medians, bound_mb)
    print_table(samples, stats, checks, header)
    return {"samples": samples, "stats": stats, "kv_mb": kv_mb, "rss_bound_mb": bound_mb,
            "targets": targets_json(checks)}
