"""Short requests beside a long prompt, on one daemon at its defaults: each short request's
first token against its first token on an idle daemon, and the long prompt's own time
beside them against the same size read alone (issue 64: within 3x idle, and at most 10%
longer).

Before the rounds and after them, `IDLE_REQUESTS` short requests one at a time give the
idle first token. Every round then reads a long prompt of `--long-tokens` tokens twice,
alone and beside short requests, the order swapped every round. Each read has a fresh
prompt (filler words of a seed of its own, cut by the daemon's tokenizer) with
`cache_prompt: false`, so nothing is reused. Beside: a short request on a connection of
its own at each of `--beside-at` seconds after the long prompt was sent. Every short
request is greedy, `SHORT_TOKENS` tokens, a prompt of its own. The long prompt's time is
its `done` line's `timings.prompt_ms`; the growth is a round's beside over its alone.
First tokens are client-side, from writing the request to its first token line.

    .venv/bin/python scripts/bench.py beside [--long-tokens 13000] [--beside-at 3,6,9]
        [--runs 4] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from benchkit.common import TIMEOUT_S, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream, fit_prompt
from benchkit.table import cell, print_head, row, summary

HELP = ("short requests beside a long prompt: their first token against idle, the long "
        "prompt's time against alone (one daemon, its defaults)")
DEFAULTS = {"runs": 4, "n_ctx": 0}
DEFAULT_AT = "3,6,9"
SHORT_TOKENS = 8
IDLE_REQUESTS = 3
# Tokens kept free below the daemon's n_ctx for a long prompt of the largest size.
MARGIN = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long-tokens", type=int, default=13000,
                        help="beside: the long prompt's tokens (at most what the daemon's "
                             "context holds; default 13000)")
    parser.add_argument("--beside-at", default=DEFAULT_AT,
                        help="beside: seconds after the long prompt at which each short "
                             f"request is sent (default {DEFAULT_AT})")


def parse_at(text: str) -> list[float]:
    try:
        delays = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--beside-at: {text!r} is not a list of seconds") from None
    if not delays or any(delay < 0 for delay in delays):
        raise ValueError(f"--beside-at: {text!r} needs seconds of 0 or more")
    return delays


def check(args: argparse.Namespace) -> list[str]:
    try:
        parse_at(args.beside_at)
    except ValueError as error:
        return [str(error)]
    return [] if args.long_tokens >= 16 else ["--long-tokens: at least 16"]


def short_prompt(number: int) -> str:
    return f"Write one sentence about the sea, number {number}."


async def first_token_ms(path: str, number: int, delay: float) -> float:
    await asyncio.sleep(delay)
    stream = await Stream.open(path)
    try:
        timed = await stream.timed({"prompt": short_prompt(number), "max_tokens": SHORT_TOKENS,
                                    "temperature": 0.0, "cache_prompt": False}, TIMEOUT_S * 10)
    finally:
        await stream.close()
    if timed.final.get("type") != "done" or not timed.arrivals:
        raise RuntimeError(f"a short request got {timed.final}")
    return (timed.arrivals[0] - timed.started) * 1e3


async def long_read(path: str, prompt: str, shorts: list[tuple[int, float]]
                    ) -> tuple[float, int, list[float]]:
    """The long prompt's prompt_ms and tokens, and each short request's first token."""
    tasks = [asyncio.create_task(first_token_ms(path, number, delay))
             for number, delay in shorts]
    stream = await Stream.open(path)
    try:
        timed = await stream.timed({"prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                    "cache_prompt": False}, TIMEOUT_S * 20)
    finally:
        await stream.close()
    firsts = list(await asyncio.gather(*tasks))
    done = timed.final
    if done.get("type") != "done":
        raise RuntimeError(f"the long prompt got {done}")
    return float(done["timings"]["prompt_ms"]), int(done["usage"]["prompt_tokens"]), firsts


async def measure(params: dict[str, Any], size: int, delays: list[float], runs: int
                  ) -> dict[str, Any]:
    daemon = await Daemon.start(params)
    path = daemon.socket_path
    numbers = iter(range(1_000_000))
    try:
        stream = await Stream.open(path)
        try:
            info = await stream.final({"op": "info"}, TIMEOUT_S)
        finally:
            await stream.close()
        size = min(size, int(info["config"]["n_ctx"]) - MARGIN)
        idle = [await first_token_ms(path, next(numbers), 0.0) for _ in range(IDLE_REQUESTS)]
        rounds: list[dict[str, Any]] = []
        for index in range(runs):
            result: dict[str, Any] = {}
            order = ("alone", "beside") if index % 2 == 0 else ("beside", "alone")
            for number, mode in enumerate(order):
                prompt = await fit_prompt(path, size, 9000 + 2 * index + number)
                shorts = ([(next(numbers), delay) for delay in delays] if mode == "beside"
                          else [])
                prompt_ms, tokens, firsts = await long_read(path, prompt, shorts)
                result[mode] = {"prompt_ms": prompt_ms, "prompt_tokens": tokens,
                                "first_token_ms": firsts}
                log(f"[beside] round {index + 1}/{runs}, {mode}: {tokens} tokens in "
                    f"{prompt_ms:.0f} ms, short requests' first tokens "
                    f"{[round(first, 1) for first in firsts]} ms")
            rounds.append(result)
        idle += [await first_token_ms(path, next(numbers), 0.0) for _ in range(IDLE_REQUESTS)]
    finally:
        await daemon.stop()
    return {"size": size, "idle_first_token_ms": idle, "rounds": rounds}


def print_tables(measured: dict[str, Any], delays: list[float], header: str
                 ) -> dict[str, float]:
    rounds, idle = measured["rounds"], measured["idle_first_token_ms"]
    print(f"Short requests beside a long prompt of {measured['size']} tokens (daemon at its "
          f"defaults), {len(delays)} short requests of {SHORT_TOKENS} tokens at "
          f"{', '.join(f'{delay:g}' for delay in delays)} s: {header}\n")
    print_head("round", "long prompt alone, ms", "beside, ms", "growth",
               "short requests' first token, ms")
    growths = []
    for index, result in enumerate(rounds, start=1):
        growth = result["beside"]["prompt_ms"] / result["alone"]["prompt_ms"] - 1
        growths.append(growth)
        print(row(index, f"{result['alone']['prompt_ms']:.0f}",
                  f"{result['beside']['prompt_ms']:.0f}", f"{growth:+.1%}",
                  ", ".join(f"{first:.1f}" for first in result["beside"]["first_token_ms"])))
    beside = [first for result in rounds for first in result["beside"]["first_token_ms"]]
    idle_median = statistics.median(idle)
    print()
    print_head("figure", "value")
    print(row("idle first token, ms", cell(summary(idle))))
    print(row("first token beside the long prompt, ms", cell(summary(beside))))
    print(row("beside / idle (median, largest)",
              f"{statistics.median(beside) / idle_median:.2f}x, "
              f"{max(beside) / idle_median:.2f}x"))
    print(row("the long prompt's growth (median of the rounds)",
              f"{statistics.median(growths):+.1%}"))
    return {"first_token_vs_idle": statistics.median(beside) / idle_median,
            "largest_first_token_vs_idle": max(beside) / idle_median,
            "growth": statistics.median(growths)}


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    delays = parse_at(args.beside_at)
    log(f"[beside] a long prompt of {args.long_tokens} tokens, short requests at "
        f"{args.beside_at} s, {bench.runs} rounds ...")
    measured = bench.runner(measure(bench.params, args.long_tokens, delays, bench.runs))
    figures = print_tables(measured, delays, bench.header)
    return {**measured, "figures": figures}
