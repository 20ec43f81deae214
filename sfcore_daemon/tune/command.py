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

This module is the command: its flags, the plan, the report and `main`. The
measuring is bench.py (the model and its contexts), sweep.py (the plan run, the best
of each) and rows.py (a step's cost by its logit rows); configfile.py writes the result.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import IO, NoReturn

from sfcore_daemon.config import Config, ConfigError, apply_overrides, load_config
from sfcore_daemon.llama import modelfile
from sfcore_daemon.system import cpus
from sfcore_daemon.tune.bench import DECODE_PROMPT_TOKENS, Bench
from sfcore_daemon.tune.configfile import (
    EXIT_USAGE,
    Recommendation,
    TuneError,
    check_writable,
    config_file,
    write_config,
)
from sfcore_daemon.tune.rows import (
    ROW_MULTIPLES,
    ROW_ROUNDS_PER_RUN,
    SAWTOOTH,
    choose_row_multiple,
    leftover_shares,
    row_sizes,
)
from sfcore_daemon.tune.sweep import TIE_TOLERANCE, Plan, Result, Sweep, best, run_sweep

PROG = "sfcore-daemon tune"
EXIT_INTERRUPTED = 130

UBATCH_CANDIDATES = (128, 256, 512)
# Other processes' share of the pinned CPUs above which the figures are flagged.
BUSY_WARNING = 0.10


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
        model_path = modelfile.resolve_model_path(config.model.path)
    except modelfile.ModelSourceError as exc:
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
