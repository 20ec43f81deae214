"""A stream's inter-token gaps while another request's grammar needs wide passes (issue 15).

One client streams `--tokens` greedy tokens; its gaps between token lines are measured
alone, then while a second client sends, back to back, a grammar request whose tokens
the model does not predict (a literal of control bytes): each such request needs grammar
passes over 32768 tokens or the whole vocabulary (~0.1 s each on the default model). The
daemon runs those passes beside the decode steps, not inside them; the table shows what
that leaves of the stream's gaps (target: p99 within 2x of normal). `--runs` alternates
three phases on one daemon: alone, beside the same requests without a grammar (the
normal gap with a second stream: the baseline), and beside the wide-pass requests;
medians (min-max) over runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from benchkit.common import TIMEOUT_S, decode_reply, log
from benchkit.context import Bench
from benchkit.daemon import Daemon
from benchkit.table import paired_ratio, summary

HELP = "a stream's inter-token gaps beside requests whose grammar needs wide passes"
DEFAULTS = {"runs": 3, "tokens": 400}

STREAM_PROMPT = "Write a long essay about the ocean."
CONTROL_LITERAL = "".join(f"\\x{byte:02x}" for byte in [3, 7, 1, 5, 2, 8, 4, 6] * 4)
WIDE_REQUEST = {"prompt": "Write about the sea.", "temperature": 0, "max_tokens": 40,
                "grammar": f'root ::= "{CONTROL_LITERAL}"'}
# The same request without a grammar: the normal gap beside a second stream (on two
# cores, about twice the gap alone), the baseline of the target.
ORDINARY_REQUEST = {key: value for key, value in WIDE_REQUEST.items() if key != "grammar"}
PHASES = {"alone": None, "ordinary": ORDINARY_REQUEST, "wide": WIDE_REQUEST}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * fraction), len(ordered) - 1)]


async def stream_gaps(path: str, tokens: int) -> list[float]:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 22)
    request = {"prompt": STREAM_PROMPT, "max_tokens": tokens, "temperature": 0,
               "grammar": "root ::= [a-z ] root", "stream": True}
    writer.write(json.dumps(request).encode() + b"\n")
    gaps, last = [], 0.0
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            reply = decode_reply(await reader.readline())
            now = time.perf_counter()
            if reply["type"] == "queued":
                continue
            if reply["type"] != "token":
                break
            if last:
                gaps.append((now - last) * 1e3)
            last = now
    writer.close()
    if reply["type"] != "done":
        raise RuntimeError(f"the stream ended with {reply}")
    return gaps


async def other_requests(path: str, request: dict[str, Any], stop: asyncio.Event,
                         record: dict[str, Any]) -> None:
    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 22)
    line = json.dumps({**request, "stream": False}).encode() + b"\n"
    while not stop.is_set():
        writer.write(line)
        reply = decode_reply(await asyncio.wait_for(reader.readline(), TIMEOUT_S))
        record["requests"] += 1
        if reply["type"] != "done":
            record["errors"].append(reply)
    writer.close()


async def phase(path: str, tokens: int, other_request: dict[str, Any] | None) -> dict[str, Any]:
    stop = asyncio.Event()
    record: dict[str, Any] = {"requests": 0, "errors": []}
    other = (asyncio.create_task(other_requests(path, other_request, stop, record))
             if other_request is not None else None)
    try:
        gaps = await stream_gaps(path, tokens)
    finally:
        stop.set()
        if other is not None:
            await other
    return {"p50": percentile(gaps, 0.5), "p90": percentile(gaps, 0.9),
            "p99": percentile(gaps, 0.99), "max": max(gaps), **record}


async def measure(args: argparse.Namespace,
                  params: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    daemon = await Daemon.start(params)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
    try:
        for index in range(args.runs):
            order = list(PHASES) if index % 2 == 0 else list(reversed(PHASES))
            for name in order:
                log(f"[run {index + 1}/{args.runs}] {name}")
                results[name].append(
                    await phase(daemon.socket_path, args.tokens, PHASES[name]))
    finally:
        await daemon.stop()
    return results


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    results: dict[str, Any] = bench.runner(measure(args, bench.params))
    ordinary, beside = results["ordinary"], results["wide"]
    print(f"one stream's inter-token gaps, ms ({args.tokens} tokens), medians (min-max) of "
          f"{args.runs} runs")
    print("| gap | alone | beside requests without grammar | beside wide-pass grammar "
          "requests | wide / without (paired) |")
    print("|---|---|---|---|---|")
    for key in ("p50", "p90", "p99", "max"):
        cells = [summary([run[key] for run in results[name]]) for name in PHASES]
        print(f"| {key} | " + " | ".join(
            f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f})" for c in cells)
            + f" | {paired_ratio(beside, key, ordinary, key):.2f} |")
    requests = [sum(run["requests"] for run in results[name]) for name in ("ordinary", "wide")]
    errors = [error for name in ("ordinary", "wide") for run in results[name]
              for error in run["errors"]]
    print(f"requests served meanwhile: {requests[0]} without grammar, {requests[1]} "
          f"wide-pass; errors: {len(errors)}")
    ratio = paired_ratio(beside, "p99", ordinary, "p99")
    print(f"target: p99 gap beside wide-pass requests <= 2x beside the same without grammar: "
          f"{'met' if ratio <= 2 else 'NOT met'} ({ratio:.2f})")
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return results

