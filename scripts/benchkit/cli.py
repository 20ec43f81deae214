"""`scripts/bench.py SECTION... [--model PATH]`: the sections named (by default
figures, structured and concurrency), one after the other, each on fresh processes; every
daemon and every peer on the same GGUF file (`--model`, by default the embedded default
model). Each section prints its tables to stdout; --json keeps every section's results,
raw samples included, under its name."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from benchkit import corpus
from benchkit.common import log
from benchkit.context import Bench
from benchkit.sections import DEFAULT, SECTIONS

# The shared options' defaults where neither the command line nor the section's DEFAULTS
# give one.
SHARED_DEFAULTS: dict[str, Any] = {"runs": 5, "tokens": 128, "n_ctx": 8192, "slots": None}


def load(name: str) -> ModuleType:
    return importlib.import_module(SECTIONS[name])


def parser_of(modules: dict[str, ModuleType]) -> argparse.ArgumentParser:
    sections = "\n".join(f"  {name:<18} {module.HELP}" for name, module in modules.items())
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"sections:\n{sections}")
    parser.add_argument("sections", nargs="*", metavar="SECTION",
                        help=f"sections to run (default: {' '.join(DEFAULT)})")
    parser.add_argument("--only", action="append", default=[], choices=list(SECTIONS),
                        help="the same as naming the section (repeatable)")
    parser.add_argument("--model", help="GGUF model of the daemon and of every peer "
                                        "(default: the embedded default model)")
    parser.add_argument("--runs", type=int, help="runs per figure (default: the section's, "
                                                 "else 5)")
    parser.add_argument("--tokens", type=int, help="decode tokens per request (default: the "
                                                   "section's, else 128)")
    parser.add_argument("--n-ctx", type=int, help="[model] n_ctx of the daemon (default: the "
                                                  "section's, else 8192)")
    parser.add_argument("--slots", type=int,
                        help="[server] slots of every daemon (default: the section's, else "
                             "the daemon's own default)")
    parser.add_argument("--seeds", type=int, default=20,
                        help="seeds per prompt and row (tools, structured-budget; default 20)")
    parser.add_argument("--daemon-config", metavar="TOML",
                        help="TOML text added to every daemon's config, e.g. "
                             "'[speculative]\\nstore_tokens = 0' (a section a bench writes "
                             "itself must not appear twice)")
    parser.add_argument("--json", default="bench_results.json", help="where to write results")
    parser.add_argument("--no-peer", action="store_true",
                        help="skip llama-cpp-python's Llama (figures, structured)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="path of llama.cpp's llama-server (default: $LLAMA_SERVER)")
    parser.add_argument("--corpus-split", choices=corpus.CHOICES, default="held-out",
                        help="speculative, concurrency: the prompt corpus's half the prompts "
                             "come from (benchkit/corpus; default held-out), both (all), or "
                             "the sections' own few prompts (builtin)")
    parser.add_argument("--ceiling-worker", help=argparse.SUPPRESS)
    for name, module in modules.items():
        if hasattr(module, "add_arguments"):
            module.add_arguments(parser.add_argument_group(f"section {name}"))
    return parser


def section_args(args: argparse.Namespace, module: ModuleType) -> argparse.Namespace:
    """The options as one section sees them: its DEFAULTS where the command line gave none."""
    values = vars(args).copy()
    for key, default in {**SHARED_DEFAULTS, **getattr(module, "DEFAULTS", {})}.items():
        if values.get(key) is None:
            values[key] = default
    return argparse.Namespace(**values)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--ceiling-worker":
        from benchkit.ceiling import ceiling_worker

        ceiling_worker(json.loads(sys.argv[2]))
        return 0
    modules = {name: load(name) for name in SECTIONS}
    parser = parser_of(modules)
    args = parser.parse_args()
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        parser.error(f"no section {', '.join(unknown)}; the sections: {', '.join(SECTIONS)}")
    names = list(dict.fromkeys([*args.sections, *args.only])) or list(DEFAULT)
    for option in ("runs", "tokens", "n_ctx", "slots", "seeds"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    for name in names:
        check = getattr(modules[name], "check", None)
        problems: list[str] = check(args) if check is not None else []
        if problems:
            parser.error("; ".join(problems))

    import uvloop

    from sfcore_daemon.llama import modelfile
    from sfcore_daemon.system import cpus

    pinned = cpus.pin(())
    n_threads, n_threads_batch = cpus.derive_threads(pinned, 0, 0)
    model = modelfile.resolve_model_path(args.model or "")
    started = time.perf_counter()
    results: dict[str, Any] = {"model": model, "sections": names}
    for index, name in enumerate(names):
        own = section_args(args, modules[name])
        params = {"model": model, "n_ctx": own.n_ctx, "n_threads": n_threads,
                  "n_threads_batch": n_threads_batch, "tokens": own.tokens,
                  "slots": own.slots,
                  "daemon_config": (own.daemon_config or "").replace("\\n", "\n"),
                  "llama_server_kv": getattr(own, "llama_server_kv", "split")}
        slots = f", daemon slots {own.slots}" if own.slots else ""
        header = (f"model {Path(model).name} ({os.path.getsize(model) / 1e6:.1f} MB), "
                  f"CPUs {pinned}, threads {n_threads}/{n_threads_batch} (decode/batch), "
                  f"n_ctx {own.n_ctx}{slots}, {own.tokens} decode tokens, medians (min-max) "
                  f"of {own.runs} runs")
        log(f"bench {name}: {header}")
        if index:
            print()
        results[name] = modules[name].run(Bench(own, params, header, uvloop.run))
    elapsed = time.perf_counter() - started
    results["elapsed_s"] = elapsed
    Path(args.json).write_text(json.dumps(results, indent=2))
    log(f"bench: {elapsed:.0f} s; results in {args.json}")
    return 0
