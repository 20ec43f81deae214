"""What `logprobs` costs a token (docs/protocol.md, Logprobs; docs/performance.md).

Two measurements:
- the numbers alone: `RowLogprobs.of` over a 262,144-logit row (the default model's
  vocabulary), in this process, for N = 0, 5 and 20 (median of many calls, microseconds);
- the daemon: one greedy streamed request of `--tokens` tokens (speculation off, so every
  token is one row) with logprobs off, 0, 5 and 20, the modes interleaved in each of
  `--runs` rounds; the median of the daemon's own `timings.decode_tok_s`.

    .venv/bin/python scripts/bench.py logprobs [--runs 5] [--tokens 128]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchkit.common import log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream

HELP = "what logprobs cost a token: the numbers alone and the daemon's decode"
DEFAULTS = {"n_ctx": 4096, "slots": 1}


PROMPT = "Write a long story about a lighthouse keeper and the storm that changed his life."
MODES: tuple[int | None, ...] = (None, 0, 5, 20)
N_VOCAB = 262_144


def row_cost_us(top: int, calls: int = 300) -> float:
    import numpy as np

    from sfcore_daemon.llama.logprobs import RowLogprobs

    rows = RowLogprobs(N_VOCAB)
    logits = (np.random.default_rng(1).standard_normal(N_VOCAB) * 3).astype(np.float32)
    times = []
    for call in range(calls):
        started = time.perf_counter_ns()
        rows.of(logits, call % N_VOCAB, top)
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1e3


async def decode_rates(params: dict[str, Any], runs: int,
                       tokens: int) -> dict[int | None, list[float]]:
    daemon = await Daemon.start(params)
    rates: dict[int | None, list[float]] = {mode: [] for mode in MODES}
    try:
        stream = await Stream.open(daemon.socket_path)
        request: dict[str, Any] = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                                   "speculative": False, "stream": True}
        await stream.figures({**request, "max_tokens": 8})  # warm
        for round_ in range(runs):
            for mode in MODES:
                asked = {} if mode is None else {"logprobs": mode}
                done = (await stream.figures({**request, **asked}))["done"]
                assert done["usage"]["completion_tokens"] == tokens, done
                rates[mode].append(done["timings"]["decode_tok_s"])
            log(f"round {round_ + 1}: " + ", ".join(
                f"{mode}: {values[-1]:.1f}" for mode, values in rates.items()))
        await stream.close()
    finally:
        await daemon.stop()
    return rates


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    costs = {}
    for top in (0, 5, 20):
        costs[top] = row_cost_us(top)
        print(f"numbers of one row, logprobs {top}: {costs[top]:.0f} us")
    rates = bench.runner(decode_rates(bench.params, args.runs, args.tokens))
    base = statistics.median(rates[None])
    print(f"\ndecode tok/s, one greedy {args.tokens}-token request, speculation off, "
          f"medians of {args.runs} (min-max)")
    print("| logprobs | decode tok/s | vs off | us per token |")
    print("|---|---|---|---|")
    for mode, values in rates.items():
        rate = statistics.median(values)
        extra = (1e6 / rate - 1e6 / base) if mode is not None else 0.0
        print(f"| {'off' if mode is None else mode} | {rate:.1f} ({min(values):.1f}-"
              f"{max(values):.1f}) | {rate / base:.3f} | {extra:+.0f} |")
    return {"row_cost_us": costs, "decode_tok_s": {str(mode): values
                                                   for mode, values in rates.items()}}

