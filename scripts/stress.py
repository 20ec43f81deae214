#!/usr/bin/env python3
"""Isolation under stress (issue 15): well-behaved streaming clients beside a hostile one.

Four clients, each on its own connection, stream greedy 64-token generations one after
another for `--seconds`. In the "hostile" phase a fifth client cycles, one request at a
time and each on a fresh connection, through malformed, refused, dead-end, huge,
abandoned and pathological requests (HOSTILE below) for the same time. The "alone" phase
is the same four clients with nobody else. Phases alternate within each run, on one
daemon with the default configuration (8 slots).

Printed: the four clients' aggregate decode rate (their completion tokens over the
phase's wall time), the gaps between their token lines, and the ratio hostile/alone
(paired per run); then every hostile kind with the outcomes it got. The exit status is 1
if any well-behaved request did not end with `done` and the tokens it asked for, if a
hostile request got anything but its expected outcome, or if the daemon logged a
traceback. `--json PATH` writes every figure (tests/lifecycle/test_stress.py reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the kit's NDJSON client (tests/kit) and the daemon's package

from benchkit.common import filler_text, log  # noqa: E402  (the path above first)
from benchkit.daemon import Daemon  # noqa: E402
from benchkit.table import paired_ratio, summary  # noqa: E402

from tests.kit.ndjson import Client  # noqa: E402

GOOD_PROMPTS = [  # each runs past 64 tokens greedily; distinct, so no client shares a prefix
    "Write a long essay about the ocean.",
    "Write a long story about a lighthouse keeper.",
    "Explain in detail how a steam engine works.",
    "Describe a long walk through an old forest.",
]
GOOD_TOKENS = 64
STEP_TIMEOUT_S = 60.0
# A literal of control bytes in no order a model predicts: at least its first token is
# found only by a grammar pass over the whole vocabulary (~0.1 s, in the shared step).
CONTROL_LITERAL = "".join(f"\\x{byte:02x}" for byte in [3, 7, 1, 5, 2, 8, 4, 6] * 4)


def outcome(reply: dict[str, Any]) -> str:
    return reply.get("code") or reply.get("finish_reason") or reply["type"]


async def final(client: Client) -> dict[str, Any]:
    """The first line that is not a token (nor a queue position); {"type": "eof"} if the
    daemon hangs up first."""
    while (reply := await client.recv(STEP_TIMEOUT_S)) is not None:
        if reply["type"] not in ("token", "queued"):
            return reply
    return {"type": "eof"}


async def ask(path: str, payload: bytes | dict[str, Any]) -> str:
    client = await Client.open(path)
    try:
        client.write(payload)
        return outcome(await final(client))
    finally:
        client.abort()


async def abandon_after(path: str, request: dict[str, Any], tokens: int) -> str:
    """Read `tokens` token lines, then hang up mid-stream."""
    client = await Client.open(path)
    try:
        client.write(request)
        read = 0
        while read < tokens:
            reply = await client.recv(STEP_TIMEOUT_S)
            if reply is not None and reply["type"] == "queued":
                continue  # its place in the queue, while the slots are busy
            if reply is None or reply["type"] != "token":
                raise RuntimeError(f"expected a token, got {reply}")
            read += 1
        return "abandoned"
    finally:
        client.abort()


async def never_read(path: str) -> str:
    """Ask for a long stream and a large tokenize, read nothing, hang up a second later."""
    client = await Client.open(path)
    try:
        client.write({"prompt": "Write.", "max_tokens": 4000, "grammar": "root ::= [a-z ] root"})
        client.write({"op": "tokenize", "text": "7 " * 300_000})
        await asyncio.sleep(1.0)  # what is measured is the others' rate meanwhile
        return "abandoned"
    finally:
        client.abort()


async def hang_up(path: str, request: dict[str, Any]) -> str:
    """Send `request` and hang up at once (its grammar pass may be running by then)."""
    client = await Client.open(path)
    await client.send(request)
    client.abort()
    return "abandoned"


async def flood(path: str) -> str:
    """Pipeline 200 requests in one write and hang up without reading."""
    client = await Client.open(path)
    await client.send(*({"op": "health", "id": i} for i in range(200)))
    client.abort()
    return "abandoned"


def hostile_kinds(path: str) -> list[tuple[str, str, Callable[[], Awaitable[str]]]]:
    """(kind, expected outcome, the request)."""
    huge_prompt = filler_text(9000, seed=3)
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    return [
        ("not JSON", "bad_json", lambda: ask(path, b"{not json\n")),
        ("nested 100,000 deep", "bad_json", lambda: ask(path, deep)),
        ("unknown field", "invalid_request",
         lambda: ask(path, {"prompt": "x", "bogus": 1})),
        ("grammar admits nothing", "invalid_request",
         lambda: ask(path, {"prompt": "x", "grammar": r"root ::= [\x00]"})),
        ("grammar dead end mid-document", "grammar_dead_end",
         lambda: ask(path, {"prompt": "Say hello.", "grammar": 'root ::= "Hello" [\\x00]',
                            "temperature": 0})),
        ("schema the converter chokes on", "invalid_request",
         lambda: ask(path, {"prompt": "x",
                            "json_schema": {"type": "string", "pattern": "^?$"}})),
        ("grammar found by whole-vocabulary passes", "stop",
         lambda: ask(path, {"prompt": "Write about the sea.", "temperature": 0,
                            "grammar": f'root ::= "{CONTROL_LITERAL}"', "max_tokens": 40})),
        ("the same, hung up at once", "abandoned",
         lambda: hang_up(path, {"prompt": "Write about the sea.", "max_tokens": 40,
                                "grammar": f'root ::= "{CONTROL_LITERAL}"'})),
        ("prompt over the context", "context_overflow",
         lambda: ask(path, {"prompt": huge_prompt, "max_tokens": 1})),
        ("line over max_line_bytes", "line_too_long",
         lambda: ask(path, b'{"prompt": "' + b"x" * (2 << 20) + b'"}\n')),
        ("max_tokens 1,000,000, left after 20 tokens", "abandoned",
         lambda: abandon_after(path, {"prompt": "Write.", "max_tokens": 1_000_000,
                                      "grammar": "root ::= [a-z ] root"}, 20)),
        ("cache_prompt false, 100 tokens", "length",
         lambda: ask(path, {"prompt": "Write a poem.", "cache_prompt": False,
                            "max_tokens": 100, "grammar": "root ::= [a-z ] root"})),
        ("reads nothing", "abandoned", lambda: never_read(path)),
        ("200 pipelined, hung up", "abandoned", lambda: flood(path)),
    ]


def over(until: float, record: dict[str, Any]) -> bool:
    """The phase ends at `until`, and not before the hostile client (if any) has been
    through every kind once."""
    return time.perf_counter() >= until and record["cycles"] != 0


async def good_client(path: str, index: int, until: float, record: dict[str, Any]) -> None:
    request = {"prompt": GOOD_PROMPTS[index], "max_tokens": GOOD_TOKENS, "temperature": 0,
               "stream": True}
    client = await Client.open(path)
    try:
        while not over(until, record):
            timed = await client.timed(request, STEP_TIMEOUT_S)
            arrivals = timed.arrivals
            record["gaps"].extend(b - a for a, b in itertools.pairwise(arrivals))
            reply = timed.final
            asked = (reply["type"] == "done" and reply["finish_reason"] == "length"
                     and reply["usage"]["completion_tokens"] == GOOD_TOKENS)
            if asked:
                record["completed"] += 1
                record["per_client"][index] += 1
                record["tokens"] += GOOD_TOKENS
            else:
                record["failed"].append(reply)
    finally:
        await client.close()


async def hostile_client(path: str, until: float, record: dict[str, Any]) -> None:
    kinds = hostile_kinds(path)
    while not over(until, record):
        for kind, expected, run in kinds:
            try:
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    got = await run()
            except Exception as exc:  # a finding to report, not a crash
                got = f"{type(exc).__name__}: {exc}"[:200]
            record["outcomes"].setdefault(kind, Counter())[got] += 1
            if got != expected:
                record["unexpected"].append({"kind": kind, "expected": expected, "got": got})
            if over(until, record):
                break
        else:
            record["cycles"] += 1


async def phase(path: str, seconds: float, hostile: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"completed": 0, "per_client": [0] * len(GOOD_PROMPTS),
                              "tokens": 0, "failed": [], "gaps": [], "outcomes": {},
                              "unexpected": [], "cycles": 0 if hostile else -1}
    started = time.perf_counter()
    until = started + seconds
    clients = [good_client(path, index, until, record) for index in range(len(GOOD_PROMPTS))]
    if hostile:
        clients.append(hostile_client(path, until, record))
    await asyncio.gather(*clients)
    wall = time.perf_counter() - started
    gaps = sorted(record.pop("gaps"))
    record["wall_s"] = wall
    record["aggregate_tok_s"] = record["tokens"] / wall
    record["gap_p50_ms"] = gaps[len(gaps) // 2] * 1e3 if gaps else float("nan")
    record["gap_p99_ms"] = gaps[int(len(gaps) * 0.99)] * 1e3 if gaps else float("nan")
    record["outcomes"] = {kind: dict(counts) for kind, counts in record["outcomes"].items()}
    return record


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from sfcore_daemon.llama import modelfile

    params = {"model": modelfile.resolve_model_path(args.model or ""), "n_ctx": 8192}
    log_path = Path(args.log) if args.log else None
    daemon = await Daemon.start(params, log_path=log_path)
    results: dict[str, Any] = {"alone": [], "hostile": []}
    try:
        for index in range(args.runs):
            order = ["hostile"] if args.no_alone else ["alone", "hostile"]
            for name in order if index % 2 == 0 else reversed(order):
                log(f"[run {index + 1}/{args.runs}] {name}, {args.seconds:g} s")
                results[name].append(
                    await phase(daemon.socket_path, args.seconds, name == "hostile"))
    finally:
        stderr = await daemon.stop()
    results["traceback_in_log"] = "Traceback" in stderr
    return results


def report(results: dict[str, Any]) -> bool:
    alone, hostile = results["alone"], results["hostile"]

    def row(label: str, key: str, digits: int = 1) -> None:
        cells = []
        for runs in (alone, hostile):
            stats = summary([run[key] for run in runs]) if runs else None
            cells.append("-" if stats is None else f"{stats['median']:.{digits}f} "
                         f"({stats['min']:.{digits}f}-{stats['max']:.{digits}f})")
        print(f"| {label} | {cells[0]} | {cells[1]} |")

    print(f"4 streaming clients ({GOOD_TOKENS} greedy tokens a request), medians (min-max) "
          f"of {max(len(alone), len(hostile))} runs")
    print("| | alone | beside the hostile client |")
    print("|---|---|---|")
    row("aggregate decode, tok/s", "aggregate_tok_s")
    row("requests completed", "completed", 0)
    row("inter-token gap p50, ms", "gap_p50_ms")
    row("inter-token gap p99, ms", "gap_p99_ms")
    if alone and hostile:
        ratio = paired_ratio(hostile, "aggregate_tok_s", alone, "aggregate_tok_s")
        met = "met" if ratio >= 0.5 else "NOT met"
        print(f"\nhostile/alone aggregate rate (paired per run): {ratio:.3f} "
              f"(target >= 0.5: {met})")
    failed = [reply for runs in (alone, hostile) for run in runs for reply in run["failed"]]
    unexpected = [item for run in hostile for item in run["unexpected"]]
    print(f"well-behaved requests that did not get {GOOD_TOKENS} tokens and done: "
          f"{len(failed)}")
    for reply in failed[:5]:
        print(f"  {reply}")
    if hostile:
        totals: dict[str, Counter[str]] = {}
        for run_record in hostile:
            for kind, counts in run_record["outcomes"].items():
                totals.setdefault(kind, Counter()).update(counts)
        print("\n| hostile request | outcomes |\n|---|---|")
        for kind, counts in totals.items():
            print(f"| {kind} | {', '.join(f'{k} x{n}' for k, n in counts.most_common())} |")
        print(f"unexpected hostile outcomes: {len(unexpected)}")
        for item in unexpected[:5]:
            print(f"  {item}")
    print(f"traceback in the daemon log: {'yes' if results['traceback_in_log'] else 'no'}")
    return not failed and not unexpected and not results["traceback_in_log"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="each phase (default 60)")
    parser.add_argument("--runs", type=int, default=3, help="alone/hostile pairs (default 3)")
    parser.add_argument("--no-alone", action="store_true",
                        help="only the hostile phase (no rate ratio)")
    parser.add_argument("--model", help="GGUF model (default: the embedded default model)")
    parser.add_argument("--log", help="write the daemon's log to this file")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    results = uvloop.run(run(args))
    ok = report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
