"""The versions section of scripts/bench.py: this checkout's daemon against another's.

`--baseline-tree DIR` names a checkout of an earlier commit (a `git worktree`, say); both
daemons run at once, with the same settings, and every round measures each figure on
both, one right after the other, who goes first alternating, so that a noisy moment on
the machine hits both. Each figure's ratio is the median of its rounds' ratios (this /
baseline, oriented so that above 1 is better), beside the two medians:

- decode, one client: greedy tokens of a warm prompt (its prefix cached), tok/s;
- first token: a short prompt no earlier request began with, ms;
- 4 clients: four distinct prompts at once, the aggregate tok/s;
- and for both, the daemon process's CPU time per generated token (user and system, all
  its threads), which a busy neighbour on a shared machine sways far less than the
  wall clock.

What a daemon measures at start-up (the step costs its drafts are judged by) would
otherwise differ between the two by the moment each was measured in: the second daemon
reads the first one's (one `step-costs/` folder beside both prompt stores), so that
the figures compare the code, not two calibrations.

Run it with `scripts/bench.py versions --baseline-tree ../before --runs 12`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import paired
from benchkit.common import filler_text
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream

HELP = "this checkout's daemon against another checkout's (--baseline-tree), paired by round"
DEFAULTS = {"runs": 12}
DECODE_PROMPT = "The history of the printing press begins"
CLIENT_PROMPTS = ["Write about the sea.", "Describe a mountain village.",
                  "Explain how bridges carry weight.", "Tell the story of a lighthouse."]
# (key, label, unit, higher is better)
FIGURES = (("decode_tok_s", "decode, 1 client", "tok/s", True),
           ("decode_cpu_ms", "decode, 1 client: CPU time per token", "ms", False),
           ("first_token_ms", "first token, short new prompt", "ms", False),
           ("clients_4_tok_s", "4 clients, aggregate", "tok/s", True),
           ("clients_4_cpu_ms", "4 clients: CPU time per token", "ms", False))


def cpu_s(pid: int) -> float:
    """The process's CPU time so far, all its threads (user and system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--baseline-tree", metavar="DIR",
                        help="the checkout whose daemon this one is compared with")


def check(args: argparse.Namespace) -> list[str]:
    return [] if args.baseline_tree else ["versions needs --baseline-tree DIR"]


async def one_round(streams: dict[str, tuple[Stream, list[Stream]]], pids: dict[str, int],
                    tokens: int, round_index: int, order: list[str]
                    ) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {name: {} for name in order}
    for name in order:
        stream, _ = streams[name]
        cpu = cpu_s(pids[name])
        decode = await stream.generate(DECODE_PROMPT, tokens)
        results[name]["decode_tok_s"] = decode["decode_tok_s"]
        results[name]["decode_cpu_ms"] = (cpu_s(pids[name]) - cpu) * 1e3 / decode["tokens"]
    for name in order:
        stream, _ = streams[name]
        fresh = f"{round_index} {name}: " + filler_text(24, seed=round_index)
        first = await stream.generate(fresh, 1)
        results[name]["first_token_ms"] = first["first_token_ms"]
    for name in order:
        _, clients = streams[name]
        cpu = cpu_s(pids[name])
        started = time.perf_counter()
        pairs = zip(clients, CLIENT_PROMPTS, strict=True)
        runs = await asyncio.gather(*(client.generate(prompt, tokens, cache=False)
                                      for client, prompt in pairs))
        elapsed = time.perf_counter() - started
        generated = sum(run["tokens"] for run in runs)
        results[name]["clients_4_tok_s"] = generated / elapsed
        results[name]["clients_4_cpu_ms"] = (cpu_s(pids[name]) - cpu) * 1e3 / generated
    return results


async def measure(params: dict[str, Any], baseline: str, rounds: int, tokens: int
                  ) -> dict[str, list[dict[str, float]]]:
    shared = Path(tempfile.mkdtemp(prefix="sfcore-versions-"))
    daemons = {}
    for name, tree in (("this", None), ("baseline", baseline)):
        store = f'[cache]\ndir = "{shared / ("store-" + name)}"\n'
        daemons[name] = await Daemon.start(params, config=store, tree=tree)
    streams: dict[str, tuple[Stream, list[Stream]]] = {}
    pids = {name: daemon.process.pid for name, daemon in daemons.items()}
    samples: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    try:
        for name, daemon in daemons.items():
            path = daemon.socket_path
            streams[name] = (await Stream.open(path),
                             [await Stream.open(path) for _ in CLIENT_PROMPTS])
            await streams[name][0].generate(DECODE_PROMPT, 1)  # the decode prompt cached
        for index in range(rounds):
            order = ["this", "baseline"] if index % 2 == 0 else ["baseline", "this"]
            result = await one_round(streams, pids, tokens, index, order)
            for name, kept in samples.items():
                kept.append(result[name])
            paired.log_round(index, rounds, result, ("this", "baseline"))
    finally:
        await paired.close(streams, daemons, shared)
    return samples


def run(bench: Bench) -> dict[str, Any]:
    args, params = bench.args, bench.params
    samples = bench.runner(measure(params, args.baseline_tree, bench.runs, params["tokens"]))
    print(f"This checkout's daemon against {args.baseline_tree}'s: {bench.header}")
    print()
    ratios = paired.table(samples, "this", "baseline", FIGURES)
    return {"samples": samples, "ratios": ratios}
