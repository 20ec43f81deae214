"""The reproducible section of scripts/bench.py: what the row-invariant kernels cost.

Two daemons of this checkout run at once on the same model, one with `[model]
reproducible = false` and one with `true` (llama.cpp's row-invariant kernels and KV cells
in position order, sfcore_daemon/llama/invariant.py). Every round measures each figure on
both, one right after the other, who goes first alternating, so that a noisy moment on
the machine hits both; each figure's ratio is the median of its rounds' ratios
(reproducible / plain, oriented so that above 1 is better), beside the two medians:

- decode, 1 client: greedy tokens of a warm prompt, tok/s;
- first token of a short new prompt, ms, and of a long new prompt (prefill), ms;
- 4 and 8 clients: distinct prompts at once, the aggregate tok/s.

The second daemon reads the first one's step costs (one `step-costs/` folder beside
both prompt stores), so that their drafts are judged alike.

Run it with `scripts/bench.py reproducible --runs 8` (`--model` for another GGUF).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from benchkit import paired
from benchkit.common import filler_text
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream

HELP = "the cost of [model] reproducible = true (row-invariant kernels), paired by round"
DEFAULTS = {"runs": 8, "tokens": 64, "slots": 8}
DECODE_PROMPT = "The history of the printing press begins"
CLIENT_PROMPTS = ["Write about the sea.", "Describe a mountain village.",
                  "Explain how bridges carry weight.", "Tell the story of a lighthouse.",
                  "Describe a desert at night.", "Explain how a clock keeps time.",
                  "Tell the story of a river.", "Write about a city in the rain."]
LONG_PROMPT_WORDS = 1500
MODES = ("plain", "reproducible")
# (key, label, unit, higher is better)
FIGURES = (("decode_tok_s", "decode, 1 client", "tok/s", True),
           ("first_token_ms", "first token, short new prompt", "ms", False),
           ("prefill_ms", f"first token, new prompt of {LONG_PROMPT_WORDS} words", "ms", False),
           ("clients_4_tok_s", "4 clients, aggregate", "tok/s", True),
           ("clients_8_tok_s", "8 clients, aggregate", "tok/s", True))


async def clients_tok_s(clients: list[Stream], count: int, tokens: int) -> float:
    started = time.perf_counter()
    runs = await asyncio.gather(*(client.generate(prompt, tokens, cache=False)
                                  for client, prompt in zip(clients[:count],
                                                            CLIENT_PROMPTS[:count],
                                                            strict=True)))
    return sum(run["tokens"] for run in runs) / (time.perf_counter() - started)


async def one_round(streams: dict[str, tuple[Stream, list[Stream]]], tokens: int,
                    round_index: int, order: list[str]) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {name: {} for name in order}
    long_prompt = filler_text(LONG_PROMPT_WORDS, seed=1000 + round_index)
    for name in order:
        stream, clients = streams[name]
        decode = await stream.generate(DECODE_PROMPT, tokens)
        results[name]["decode_tok_s"] = decode["decode_tok_s"]
        fresh = f"{round_index} {name}: " + filler_text(24, seed=round_index)
        results[name]["first_token_ms"] = (await stream.generate(fresh, 1))["first_token_ms"]
        results[name]["prefill_ms"] = (await stream.generate(
            long_prompt, 1, cache=False))["first_token_ms"]
        results[name]["clients_4_tok_s"] = await clients_tok_s(clients, 4, tokens)
        results[name]["clients_8_tok_s"] = await clients_tok_s(clients, 8, tokens)
    return results


async def measure(params: dict[str, Any], rounds: int, tokens: int
                  ) -> dict[str, list[dict[str, float]]]:
    shared = Path(tempfile.mkdtemp(prefix="sfcore-reproducible-"))
    daemons = {}
    streams: dict[str, tuple[Stream, list[Stream]]] = {}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in MODES}
    try:
        for name in MODES:
            config = (f'[cache]\ndir = "{shared / ("store-" + name)}"\n'
                      f"[model]\nreproducible = {'true' if name == 'reproducible' else 'false'}\n")
            daemons[name] = await Daemon.start(params, config=config)
            path = daemons[name].socket_path
            streams[name] = (await Stream.open(path),
                             [await Stream.open(path) for _ in CLIENT_PROMPTS])
            await streams[name][0].generate(DECODE_PROMPT, 1)  # the decode prompt cached
        for index in range(rounds):
            order = list(MODES) if index % 2 == 0 else list(reversed(MODES))
            result = await one_round(streams, tokens, index, order)
            for name, kept in samples.items():
                kept.append(result[name])
            paired.log_round(index, rounds, result, MODES)
    finally:
        await paired.close(streams, daemons, shared)
    return samples


def run(bench: Bench) -> dict[str, Any]:
    params = bench.params
    samples = bench.runner(measure(params, bench.runs, params["tokens"]))
    print(f"reproducible = true against false, the same checkout: {bench.header}")
    print()
    ratios = paired.table(samples, "reproducible", "plain", FIGURES)
    return {"samples": samples, "ratios": ratios}
