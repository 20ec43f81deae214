"""`sfcore-daemon tune`: measure decode and prefill speed, recommend thread counts and n_ubatch.

The tuner pins itself to the configured CPU set, loads the model once with the
daemon's own model and context settings, and sweeps:

- decode threads (1..n pinned CPUs): greedy single-token decodes, tokens/s;
- prefill threads x n_ubatch: a fixed prompt evaluated in n_batch chunks, tokens/s;
- the cost of a step by its logit rows (one sequence, every row asking for logits, at
  the best decode thread count): whether rows past a multiple of 2, 4 or 8 cost a whole
  pass of the output matrix, which `[speculative] row_multiple` rounds drafts around.

Decode speed does not depend on n_ubatch and prefill speed does not depend on the
decode thread count, so the two sweeps are separate. Each figure is the median of
--runs runs. With --write the best values go into the config file.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any, NoReturn

import msgspec

from sfcore_daemon.config import Config, ConfigError, apply_overrides, load_config
from sfcore_daemon.llama import modelfile as models
from sfcore_daemon.system import cpus
from sfcore_daemon.tune.configfile import (
    EXIT_USAGE,
    Recommendation,
    TuneError,
    check_writable,
    config_file,
    write_config,
)

PROG = "sfcore-daemon tune"
EXIT_INTERRUPTED = 130

UBATCH_CANDIDATES = (128, 256, 512)
# Results this close to the fastest count as equal; the cheaper setting wins.
TIE_TOLERANCE = 0.02
# Decode is measured after a short prompt, as in a typical chat turn's first tokens.
DECODE_PROMPT_TOKENS = 16
# Other processes' share of the pinned CPUs above which the figures are flagged.
BUSY_WARNING = 0.10
# Row multiples tried for [speculative] row_multiple, largest first. A kernel that takes
# logit rows m at a time and makes another pass over the whole output matrix for the
# rows left over (llamafile's tinyBLAS does with a Q8_0 output on x86: m = 4) costs about
# as much for k*m + 1 rows as for k*m + m: the first row past a multiple costs at least
# SAWTOOTH of the whole next multiple's rows. Where each row costs the same, that share
# is 1/m.
ROW_MULTIPLES = (8, 4, 2)
ROW_GROUPS = (1, 2, 3)  # k in k*m: the multiples compared
SAWTOOTH = 0.75
# Step sizes are measured this many times per --runs run (each a few tens of ms), in a
# shuffled order each round so that drift spreads over all of them.
ROW_ROUNDS_PER_RUN = 3
# Real text, so the prompt tokens look like what the daemon evaluates.
PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. Local language models answer "
    "questions, summarise documents and write code on ordinary hardware. "
    "Memory bandwidth bounds token generation, while prompt evaluation is bound "
    "by arithmetic, so the best thread counts for the two often differ. "
)


# --- command line -----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print the usage block too; one line is the CLI's promise.
        raise TuneError(f"{message} (see --help)", EXIT_USAGE)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    values = {_positive_int(part.strip()) for part in text.split(",") if part.strip()}
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(sorted(values))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Measure decode and prompt (prefill) speed over thread counts and "
                    "n_ubatch values on this machine, and a step's cost by its logit rows, "
                    "and recommend the fastest settings.",
    )
    parser.add_argument("--config", metavar="PATH",
                        help="config file (default: ./server_config.toml if present, "
                             "else built-in defaults)")
    parser.add_argument("--model", metavar="PATH", help="override [model] path (a GGUF file)")
    parser.add_argument("--runs", metavar="N", type=_positive_int, default=3,
                        help="runs per measurement; the median is reported (default 3)")
    parser.add_argument("--tokens", metavar="N", type=_positive_int, default=64,
                        help="tokens decoded per decode run (default 64)")
    parser.add_argument("--prompt-tokens", metavar="N", type=_positive_int, default=512,
                        help="prompt length of a prefill run (default 512)")
    parser.add_argument("--threads", metavar="LIST", type=_int_list,
                        help="thread counts to try, e.g. 2,4 (default: 1..number of pinned CPUs)")
    parser.add_argument("--ubatch", metavar="LIST", type=_int_list,
                        help="n_ubatch values to try, e.g. 128,512 "
                             "(default: 128, 256, 512 up to n_batch, and the configured one)")
    parser.add_argument("--write", action="store_true",
                        help="store the recommended values in the config file "
                             "(comments in it are not preserved)")
    return parser


# --- the plan ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Plan:
    decode_threads: tuple[int, ...]
    batch_threads: tuple[int, ...]
    # The first value is the context the decode sweep runs on.
    ubatches: tuple[int, ...]
    runs: int
    decode_tokens: int
    prompt_tokens: int

    @property
    def steps(self) -> int:
        # The last step: the logit-row costs.
        return len(self.decode_threads) + len(self.batch_threads) * len(self.ubatches) + 1


def make_plan(args: argparse.Namespace, config: Config, pinned: Sequence[int]) -> Plan:
    model = config.model
    threads = _thread_counts(args.threads, len(pinned))
    # llama.cpp caps n_batch at n_ctx, and n_ubatch at n_batch.
    n_batch = min(model.n_batch, model.n_ctx)
    ubatches = _ubatch_values(args.ubatch, n_batch, model.n_ubatch)
    if args.prompt_tokens < 2:
        # A one-token batch runs with the decode thread count, not the batch one.
        raise TuneError("--prompt-tokens must be at least 2", EXIT_USAGE)
    if args.prompt_tokens > model.n_ctx:
        raise TuneError(f"--prompt-tokens {args.prompt_tokens} exceeds [model] n_ctx "
                        f"{model.n_ctx}", EXIT_USAGE)
    if DECODE_PROMPT_TOKENS + args.tokens > model.n_ctx:
        raise TuneError(f"--tokens {args.tokens} does not fit in [model] n_ctx {model.n_ctx} "
                        f"after a {DECODE_PROMPT_TOKENS}-token prompt", EXIT_USAGE)
    return Plan(threads, threads, ubatches, args.runs, args.tokens, args.prompt_tokens)


def _thread_counts(requested: tuple[int, ...] | None, n_cpus: int) -> tuple[int, ...]:
    if requested is None:
        return tuple(range(1, n_cpus + 1))
    too_many = [n for n in requested if n > n_cpus]
    if too_many:
        raise TuneError(f"--threads: {too_many[0]} is more than the {n_cpus} CPUs pinned "
                        "(see [runtime] cpu_affinity)", EXIT_USAGE)
    return requested


def _ubatch_values(requested: tuple[int, ...] | None, n_batch: int,
                   configured: int) -> tuple[int, ...]:
    if requested is not None:
        too_big = [n for n in requested if n > n_batch]
        if too_big:
            raise TuneError(f"--ubatch: {too_big[0]} exceeds n_batch {n_batch} "
                            "(n_ubatch must not exceed [model] n_batch or n_ctx)", EXIT_USAGE)
        values = requested
    elif n_batch < UBATCH_CANDIDATES[0]:
        values = (n_batch,)
    else:
        values = tuple(n for n in UBATCH_CANDIDATES if n <= n_batch)
    configured = min(configured, n_batch)
    if requested is None:
        values = tuple(sorted({*values, configured}))
    # Decode does not depend on n_ubatch: run it on the configured context when swept.
    first = configured if configured in values else values[0]
    return (first, *(n for n in values if n != first))


# --- measuring --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    threads: int
    n_ubatch: int
    rates: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> str:
        return f"{min(self.rates):.1f}-{max(self.rates):.1f}"


def row_sizes() -> tuple[int, ...]:
    """The step sizes (logit rows) choose_row_multiple compares."""
    return tuple(sorted({k * m + extra for m in ROW_MULTIPLES for k in ROW_GROUPS
                         for extra in (0, 1, m)}))


def leftover_shares(costs: dict[int, float]) -> dict[int, float]:
    """For each candidate multiple m: the median over k of what the first row past k*m
    adds to a step, as a share of what the next m rows together add."""
    shares: dict[int, float] = {}
    for m in ROW_MULTIPLES:
        ratios = []
        for k in ROW_GROUPS:
            first = costs[k * m + 1] - costs[k * m]
            whole = costs[(k + 1) * m] - costs[k * m]
            # A whole group no dearer than the one row: that row is all of the cost.
            ratios.append(first / whole if whole > 0 else (math.inf if first > 0 else 0.0))
        shares[m] = statistics.median(ratios)
    return shares


def choose_row_multiple(costs: dict[int, float]) -> int:
    """The largest multiple whose leftover rows cost about a whole group; 1 (no
    rounding) where rows cost what they cost one by one."""
    shares = leftover_shares(costs)
    return next((m for m in ROW_MULTIPLES if shares[m] >= SAWTOOTH), 1)


@dataclass(slots=True)
class Sweep:
    decode: list[Result] = field(default_factory=list)
    prefill: list[Result] = field(default_factory=list)
    # Median ms of a step by its logit rows, and the decode thread count they ran at.
    row_costs: dict[int, float] = field(default_factory=dict)
    row_threads: int = 1
    # Share of the pinned CPUs' time that other processes took meanwhile.
    others_share: float = 0.0


def _silence_llama_logs() -> None:
    """llama.cpp's lines go nowhere; a load failure still reaches the user through
    ModelLoadError, which carries llama.cpp's own reason."""
    from sfcore_daemon.llama.logrouter import route_llama_logs

    route_llama_logs()
    llama_log = logging.getLogger("sfcore_daemon.llama_cpp")
    llama_log.setLevel(logging.CRITICAL + 1)
    llama_log.propagate = False


class Bench:
    """One loaded model; contexts are created per n_ubatch on demand.

    Every llama_decode runs on the thread that created the Bench: libgomp keeps a
    worker team per calling thread, and decoding from a second thread cost 25%
    decode speed on the 2-CPU machine this was written on.
    """

    def __init__(self, model_path: str, config: Config, pinned: Sequence[int]) -> None:
        from sfcore_daemon.llama.capi import C
        from sfcore_daemon.llama.model import ModelLoadError, load_model

        self.C = C
        self.config = config
        self.pinned = pinned
        _silence_llama_logs()
        try:
            self.model = load_model(model_path, config.model)
        except ModelLoadError as exc:
            raise TuneError(str(exc)) from None
        self.vocab = C.llama_model_get_vocab(self.model)

    def close(self) -> None:
        self.C.llama_model_free(self.model)
        self.C.llama_backend_free()

    def prompt(self, n_tokens: int) -> Any:
        """`n_tokens` tokens of real text (BOS first), as a ctypes array."""
        C = self.C
        data = PROMPT_TEXT.encode()
        buffer = (C.llama_token * (len(data) + 8))()
        n = C.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), False, False)
        text = list(buffer[:max(n, 0)]) or [0]
        bos = C.llama_vocab_bos(self.vocab)
        tokens = ([bos] if bos >= 0 else []) + text * math.ceil(n_tokens / len(text))
        return (C.llama_token * n_tokens)(*tokens[:n_tokens])

    @contextmanager
    def context(self, n_ubatch: int) -> Iterator[Context]:
        from sfcore_daemon.llama.model import context_params

        model_config = msgspec.structs.replace(self.config.model, n_ubatch=n_ubatch)
        # Logits for every row of the largest step row_costs measures (llama.cpp
        # aborts on a step with more logit rows than the context reserved).
        params = context_params(model_config, 1, 1, draft_rows=max(row_sizes()))
        ctx = self.C.llama_init_from_model(self.model, params)
        if not ctx:
            raise TuneError(f"cannot create a context with n_ctx={model_config.n_ctx} "
                            f"n_ubatch={n_ubatch} (out of memory?)")
        try:
            yield Context(self.C, ctx)
        finally:
            self.C.llama_free(ctx)


class Context:
    """One llama_context, measured at different thread counts."""

    def __init__(self, C: Any, ctx: Any) -> None:
        self.C = C
        self.ctx = ctx
        self.memory = self.C.llama_get_memory(ctx)
        self.n_batch = self.C.llama_n_batch(ctx)
        self.n_ubatch = self.C.llama_n_ubatch(ctx)

    def warm_up(self, prompt: Any) -> None:
        """One full ubatch first: it touches the model's pages and the largest compute graph."""
        self._clear()
        self._evaluate(prompt, min(len(prompt), self.n_ubatch))

    def prefill_rate(self, prompt: Any, n_tokens: int, n_threads_batch: int) -> float:
        C = self.C
        C.llama_set_n_threads(self.ctx, 1, n_threads_batch)
        self._clear()
        started = time.perf_counter_ns()
        self._evaluate(prompt, n_tokens)
        C.llama_synchronize(self.ctx)
        return n_tokens * 1e9 / (time.perf_counter_ns() - started)

    def decode_rate(self, prompt: Any, n_threads: int, n_tokens: int) -> float:
        C, ctx = self.C, self.ctx
        C.llama_set_n_threads(ctx, n_threads, n_threads)
        self._clear()
        self._evaluate(prompt, DECODE_PROMPT_TOKENS)
        sampler = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        C.llama_sampler_chain_add(sampler, C.llama_sampler_init_greedy())
        one_token = (C.llama_token * 1)()
        one_batch = C.llama_batch_get_one(one_token, 1)
        sample, decode = C.llama_sampler_sample, C.llama_decode
        try:
            started = time.perf_counter_ns()
            # End-of-generation tokens are decoded like any other: every run does the same work.
            for _ in range(n_tokens):
                one_token[0] = sample(sampler, ctx, -1)
                if decode(ctx, one_batch) != 0:
                    raise TuneError("llama_decode failed while decoding")
            elapsed = time.perf_counter_ns() - started
        finally:
            C.llama_sampler_free(sampler)
        return n_tokens * 1e9 / elapsed

    def row_costs(self, prompt: Any, n_threads: int, sizes: Sequence[int],
                  rounds: int) -> dict[int, float]:
        """Median ms of one llama_decode of each size in `sizes` (rows of one sequence
        after a short prompt, every row asking for logits, as a step verifying a draft),
        over `rounds` rounds in a shuffled order each."""
        C, ctx = self.C, self.ctx
        C.llama_set_n_threads(ctx, n_threads, n_threads)
        self._clear()
        self._evaluate(prompt, DECODE_PROMPT_TOKENS)
        most = max(sizes)
        batch = C.llama_batch_init(most, 0, 1)
        order = random.Random(0)
        samples: dict[int, list[float]] = {size: [] for size in sizes}
        try:
            for row in range(most):
                batch.token[row] = prompt[row % len(prompt)]
                batch.pos[row] = DECODE_PROMPT_TOKENS + row
                batch.n_seq_id[row] = 1
                batch.seq_id[row][0] = 0
                batch.logits[row] = 1
            for _ in range(rounds):
                shuffled = list(sizes)
                order.shuffle(shuffled)
                for size in shuffled:
                    batch.n_tokens = size
                    started = time.perf_counter_ns()
                    if C.llama_decode(ctx, batch) != 0:
                        raise TuneError(f"llama_decode failed on a {size}-row step")
                    C.llama_synchronize(ctx)
                    samples[size].append((time.perf_counter_ns() - started) / 1e6)
                    C.llama_memory_seq_rm(self.memory, 0, DECODE_PROMPT_TOKENS, -1)
        finally:
            C.llama_batch_free(batch)
        return {size: statistics.median(times) for size, times in samples.items()}

    def _clear(self) -> None:
        # Outside the timed part: with data=True it zeroes the whole KV cache
        # (150 MB at n_ctx 8192 for the default model).
        self.C.llama_memory_clear(self.memory, True)

    def _evaluate(self, prompt: Any, n_tokens: int) -> None:
        """Evaluate prompt[:n_tokens] in n_batch chunks, as the daemon does."""
        C = self.C
        base, size = ctypes.addressof(prompt), ctypes.sizeof(C.llama_token)
        for pos in range(0, n_tokens, self.n_batch):
            chunk = min(self.n_batch, n_tokens - pos)
            start = ctypes.cast(base + pos * size, C.llama_token_p)
            if C.llama_decode(self.ctx, C.llama_batch_get_one(start, chunk)) != 0:
                raise TuneError(f"llama_decode failed on a {chunk}-token batch")


def run_sweep(bench: Bench, plan: Plan, progress: Callable[[str], None]) -> Sweep:
    prompt = bench.prompt(max(plan.prompt_tokens, DECODE_PROMPT_TOKENS, *plan.ubatches))
    watch = CpuWatch(bench.pinned)
    sweep = Sweep()
    step = 0

    def measure(label: str, run: Callable[[], float]) -> tuple[float, ...]:
        nonlocal step
        step += 1
        rates = tuple(run() for _ in range(plan.runs))
        progress(f"[{step}/{plan.steps}] {label}: {statistics.median(rates):.1f} tok/s")
        return rates

    for index, n_ubatch in enumerate(plan.ubatches):
        with bench.context(n_ubatch) as context:
            context.warm_up(prompt)
            if index == 0:
                for threads in plan.decode_threads:
                    rates = measure(f"decode threads={threads}", partial(
                        context.decode_rate, prompt, threads, plan.decode_tokens))
                    sweep.decode.append(Result(threads, n_ubatch, rates))
                step += 1
                progress(f"[{step}/{plan.steps}] logit rows a step: "
                         f"{_measure_rows(context, prompt, plan, sweep)}")
            for threads in plan.batch_threads:
                rates = measure(f"prefill threads_batch={threads} n_ubatch={n_ubatch}", partial(
                    context.prefill_rate, prompt, plan.prompt_tokens, threads))
                sweep.prefill.append(Result(threads, n_ubatch, rates))
    sweep.others_share = watch.others_share()
    sweep.prefill.sort(key=lambda r: (r.n_ubatch, r.threads))
    return sweep


def _measure_rows(context: Context, prompt: Any, plan: Plan, sweep: Sweep) -> str:
    """Step costs by logit rows into `sweep`, at the best decode thread count."""
    if context.n_batch < max(row_sizes()):
        return f"not measured (n_batch {context.n_batch} is below {max(row_sizes())})"
    sweep.row_threads = best(sweep.decode).threads
    sweep.row_costs = context.row_costs(prompt, sweep.row_threads, row_sizes(),
                                        plan.runs * ROW_ROUNDS_PER_RUN)
    return f"row_multiple {choose_row_multiple(sweep.row_costs)}"


def best(results: Sequence[Result]) -> Result:
    """The cheapest result (fewest threads, then smallest n_ubatch) within TIE_TOLERANCE
    of the fastest: the same speed for less CPU and less memory."""
    fastest = max(result.median for result in results)
    close = [r for r in results if r.median >= fastest * (1 - TIE_TOLERANCE)]
    return min(close, key=lambda r: (r.threads, r.n_ubatch))


class CpuWatch:
    """How much of the pinned CPUs' time went to other processes (or the hypervisor).

    The daemon's threads normally have their CPUs to themselves; on a busy machine
    more threads look slower than they are, so such a sweep is flagged.
    """

    def __init__(self, pinned: Sequence[int]) -> None:
        import psutil

        self._process = psutil.Process()
        self._pinned = list(pinned)
        self._start = self._snapshot()

    def others_share(self) -> float:
        wall, busy, own = (end - start for end, start in zip(
            self._snapshot(), self._start, strict=True))
        capacity = wall * len(self._pinned)
        return max(0.0, (busy - own) / capacity) if capacity > 0 else 0.0

    def _snapshot(self) -> tuple[float, float, float]:
        import psutil

        per_cpu = psutil.cpu_times(percpu=True)
        busy = sum(_busy_seconds(per_cpu[cpu]) for cpu in self._pinned if cpu < len(per_cpu))
        own = self._process.cpu_times()
        return time.monotonic(), busy, float(own.user + own.system)


def _busy_seconds(times: Any) -> float:
    # As psutil.cpu_percent counts it: guest time is already inside user and nice,
    # and steal counts as busy (a vCPU the hypervisor gave away was not ours either).
    not_busy = float(times.idle + getattr(times, "iowait", 0.0))
    counted_twice = float(getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0))
    return float(sum(times)) - not_busy - counted_twice


# --- output -----------------------------------------------------------------------------


def recommend(sweep: Sweep, configured_row_multiple: int) -> Recommendation:
    decode, prefill = best(sweep.decode), best(sweep.prefill)
    row_multiple = (choose_row_multiple(sweep.row_costs) if sweep.row_costs
                    else configured_row_multiple)
    return Recommendation(decode.threads, prefill.threads, prefill.n_ubatch, row_multiple)


def print_report(out: IO[str], sweep: Sweep, plan: Plan, config: Config,
                 pinned: Sequence[int]) -> Recommendation:
    runs = f"median of {plan.runs} run{'s' if plan.runs > 1 else ''}"
    out.write(f"decode: {plan.decode_tokens} tokens after a {DECODE_PROMPT_TOKENS}-token "
              f"prompt, {runs}\n")
    _print_table(out, sweep.decode, with_ubatch=False)
    n_batch = min(config.model.n_batch, config.model.n_ctx)
    out.write(f"\nprefill: {plan.prompt_tokens}-token prompt in chunks of n_batch {n_batch}, "
              f"{runs}\n")
    _print_table(out, sweep.prefill, with_ubatch=True)
    out.write(f"\n* best: fewest threads, then smallest n_ubatch, within {TIE_TOLERANCE:.0%} "
              "of the fastest\n\n")
    _print_rows(out, sweep, plan)
    if sweep.others_share > BUSY_WARNING:
        out.write(f"note: other processes kept the pinned CPUs {sweep.others_share:.0%} busy "
                  "during the sweep,\nso these figures are off; rerun on an idle machine\n\n")
    recommended = recommend(sweep, config.speculative.row_multiple)
    runtime = config.runtime
    n_threads, n_threads_batch = cpus.derive_threads(
        pinned, runtime.n_threads, runtime.n_threads_batch)
    out.write(f"recommended: n_threads = {recommended.n_threads}, "
              f"n_threads_batch = {recommended.n_threads_batch}, "
              f"n_ubatch = {recommended.n_ubatch}, row_multiple = {recommended.row_multiple}\n")
    out.write(f"configured:  n_threads = {_configured(runtime.n_threads, n_threads)}, "
              f"n_threads_batch = {_configured(runtime.n_threads_batch, n_threads_batch)}, "
              f"n_ubatch = {config.model.n_ubatch}, "
              f"row_multiple = {config.speculative.row_multiple}\n")
    return recommended


def _print_rows(out: IO[str], sweep: Sweep, plan: Plan) -> None:
    if not sweep.row_costs:
        out.write(f"logit rows a step: not measured (n_batch is below {max(row_sizes())}); "
                  "row_multiple stays as configured\n\n")
        return
    rounds = plan.runs * ROW_ROUNDS_PER_RUN
    out.write(f"logit rows a step: one sequence after a {DECODE_PROMPT_TOKENS}-token prompt, "
              f"every row with logits, threads={sweep.row_threads}, ms, median of "
              f"{rounds} rounds\n")
    sizes = sorted(sweep.row_costs)
    out.write("  rows " + "".join(f"{size:>7}" for size in sizes) + "\n")
    out.write("  ms   " + "".join(f"{sweep.row_costs[size]:>7.1f}" for size in sizes) + "\n")
    shares = leftover_shares(sweep.row_costs)
    out.write("  the first row past a multiple m, as a share of the next m rows: " + ", ".join(
        f"m={m} {shares[m]:.2f}" for m in ROW_MULTIPLES) + f" (rounding pays from "
        f"{SAWTOOTH:.2f})\n\n")


def _print_table(out: IO[str], results: Sequence[Result], *, with_ubatch: bool) -> None:
    winner = best(results)
    threads = "threads_batch" if with_ubatch else "threads"
    width = len(threads)
    ubatch = f"  {'n_ubatch':>8}" if with_ubatch else ""
    out.write(f"    {threads}{ubatch}  {'tok/s':>8}  {'min-max':>13}\n")
    for r in results:
        mark = "*" if r is winner else " "
        ubatch = f"  {r.n_ubatch:>8}" if with_ubatch else ""
        out.write(f"  {mark} {r.threads:>{width}}{ubatch}  {r.median:>8.1f}  {r.spread:>13}\n")


def _configured(value: int, effective: int) -> str:
    return f"{value} (derived: {effective})" if value == 0 else str(value)


def _describe_cpus(pinned: Sequence[int]) -> str:
    return f"{len(pinned)} CPU{'s' if len(pinned) != 1 else ''} ({','.join(map(str, pinned))})"


# --- main -------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    try:
        return _tune(argv)
    except TuneError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted\n")
        return EXIT_INTERRUPTED


def _tune(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        config = apply_overrides(load_config(args.config), model__path=args.model)
    except ConfigError as exc:
        raise TuneError(str(exc), EXIT_USAGE) from None
    target = config_file(args)
    if args.write:
        check_writable(target)
    try:
        # Pin first: llama.cpp's worker threads inherit the mask when they are created.
        pinned = cpus.pin(config.runtime.cpu_affinity)
    except cpus.CpuError as exc:
        raise TuneError(str(exc)) from None
    plan = make_plan(args, config, pinned)
    try:
        model_path = models.resolve_model_path(config.model.path)
    except models.ModelSourceError as exc:
        raise TuneError(str(exc)) from None
    # Must be set before llama.cpp (and any BLAS it links) is loaded.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    def progress(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    progress(f"tuning {model_path} on {_describe_cpus(pinned)}, n_ctx {config.model.n_ctx}: "
             f"{plan.steps} measurements x {plan.runs} runs")
    bench = Bench(model_path, config, pinned)
    try:
        sweep = run_sweep(bench, plan, progress)
    finally:
        bench.close()
    recommended = print_report(sys.stdout, sweep, plan, config, pinned)
    if args.write:
        existed = target.exists()
        write_config(target, recommended)
        note = " (comments and layout are not preserved: tomli-w rewrites the file)"
        sys.stdout.write(f"\nwrote n_threads, n_threads_batch, n_ubatch and row_multiple to "
                         f"{target}"
                         f"{note if existed else ''}\n")
    else:
        sys.stdout.write(f"\nrun with --write to store these values in {target}\n")
    return 0
