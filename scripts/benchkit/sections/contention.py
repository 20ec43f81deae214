"""Decode on a shared machine: the daemon and llama-server idle and beside other work.

    .venv/bin/python scripts/bench.py contention [--contention-mode loads|spin|idle-pair|all]
        [--runs 3] [--tokens 128] [--llama-server PATH] [--json PATH]
        [--loads idle,busy1,busy2,build,build-nice] [--spin 0,1k,3k,10k,30k,100k,default]
        [--server-spin SPIN] [--adaptive on|off] [--workload-src FILE]

Both sides run the same model and threads (llama-server: the same llama.cpp built with
OpenMP, `-t`/`-tb` as the daemon's); every figure is one greedy generation of `--tokens`
tokens, timed on the client's side from the first token's arrival to the last's
(the daemon's NDJSON stream, llama-server's streamed /completion). Round by round,
in one sitting, every load is measured on both sides; which side goes first alternates,
so a noisy moment on a shared machine hits both.

- `loads`: the daemon as shipped (its GOMP_SPINCOUNT default, adaptive threads on) and
  llama-server as users run it (libgomp's default spin, or `--server-spin`), idle,
  beside 1 and 2 busy processes (`while True: pass`, unpinned), and beside a compile
  (two compiler loops, as `make -j2`, plain and under `nice -n 19`). The ratios are
  paired: each round's loaded figure over the same round's idle one.
- `spin`: GOMP_SPINCOUNT swept for both sides (`default` = libgomp's own 300,000, so
  the daemon's default is overridden too), idle and beside one busy process; the
  daemon's adaptive threads off unless `--adaptive on`, so that the spin window alone
  is measured. All processes are up at once and the values alternate round by round.
- `idle-pair`: idle decode of the daemon as shipped against the daemon as it was before
  (GOMP_SPINCOUNT=300000, adaptive threads off), alternated, for the "idle within 2%"
  check.

Prints a Markdown table of medians (min-max) and ratios per mode; every sample goes to
the JSON file. Progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchkit.common import TIMEOUT_S, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.peers import LlamaServer
from benchkit.table import summary

HELP = ("decode idle and beside busy processes and a compile, daemon and llama-server; "
        "GOMP_SPINCOUNT sweep; idle against the old defaults")
DEFAULTS = {"runs": 3, "tokens": 128, "n_ctx": 2048}

PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a bottle. "
          "Once upon a time,")
LIBGOMP_DEFAULT = "300000"
SPIN_VALUES = {"0": "0", "100": "100", "1k": "1000", "3k": "3000", "10k": "10000",
               "30k": "30000", "100k": "100000", "default": LIBGOMP_DEFAULT}
LOADS = ("idle", "busy1", "busy2", "build", "build-nice")
# A C file the compile load builds over and over: plain functions the optimizer works
# on for a few seconds, like one of llama.cpp's translation units.
_SYNTHETIC_C = "\n".join(
    f"double f{i}(const double *x, int n) {{ double s = {i}; "
    f"for (int k = 0; k < n; k++) s = s * 0.5 + x[k] * {i % 7 + 1} - (k ^ {i}); "
    f"return s; }}" for i in range(4000))


# --- the loads ----------------------------------------------------------------------------


@contextlib.contextmanager
def load_of(kind: str, workload_src: Path) -> Iterator[None]:
    """Other processes for the duration of a measurement: none, busy loops, a compile."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        if kind.startswith("busy"):
            for _ in range(int(kind[4:])):
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL))
        elif kind.startswith("build"):
            nice = ["nice", "-n", "19"] if kind == "build-nice" else []
            compiler = shutil.which("cc") or shutil.which("gcc") or "cc"
            loop = (f'while :; do {compiler} -O2 -c "{workload_src}" '
                    f'-o /dev/null 2>/dev/null; done')
            for _ in range(2):  # as make -j2
                processes.append(subprocess.Popen([*nice, "sh", "-c", loop],
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
        if processes:
            time.sleep(0.5)  # let the scheduler place them before the clock starts
        yield
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                if kind.startswith("build"):
                    os.killpg(process.pid, 9)
                else:
                    process.kill()
            process.wait()


# --- the two sides ------------------------------------------------------------------------


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """os.environ with `values` (None: removed) while a child is spawned."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class DaemonSide:
    def __init__(self, daemon: Daemon, label: str) -> None:
        self.daemon, self.label = daemon, label
        self.log_text = ""  # its log, once stopped

    @classmethod
    async def start(cls, params: dict[str, Any], label: str, spin: str | None,
                    adaptive: bool) -> DaemonSide:
        config = f"[runtime]\nadaptive_threads = {'true' if adaptive else 'false'}\n"
        with environment(GOMP_SPINCOUNT=spin, OMP_WAIT_POLICY=None):
            daemon = await Daemon.start(params, config=config, log_level="info",
                                        log_path=Path(tempfile.mkstemp(
                                            prefix="sfbench-contention-", suffix=".log")[1]))
        return cls(daemon, label)

    async def decode(self, tokens: int) -> float:
        stream = await Stream.open(self.daemon.socket_path)
        try:
            figures = await stream.figures({"prompt": PROMPT, "max_tokens": tokens,
                                            "temperature": 0.0})
        finally:
            await stream.close()
        return float(figures["decode_tok_s"])

    async def threads(self) -> dict[str, Any]:
        stream = await Stream.open(self.daemon.socket_path)
        try:
            stream.writer.write(b'{"op": "stats"}\n')
            line = await asyncio.wait_for(stream.reader.readline(), TIMEOUT_S)
        finally:
            await stream.close()
        threads: dict[str, Any] = json.loads(line)["threads"]
        return threads

    async def stop(self) -> str:
        log_path = self.daemon.log_path
        try:
            self.log_text = await self.daemon.stop()
        finally:
            if log_path is not None:
                log_path.unlink(missing_ok=True)
        return self.log_text


class ServerSide:
    def __init__(self, server: LlamaServer, label: str) -> None:
        self.server, self.label = server, label

    @classmethod
    def start(cls, binary: str, params: dict[str, Any], label: str,
              spin: str | None) -> ServerSide:
        with environment(GOMP_SPINCOUNT=spin, OMP_WAIT_POLICY=None):
            server = LlamaServer.start(binary, {**params, "llama_server_kv": "unified"}, 1)
        return cls(server, label)

    def decode(self, tokens: int) -> float:
        """Streamed /completion: tokens after the first over the time from the first
        token's event to the last's, as the client sees them."""
        body = json.dumps({"prompt": PROMPT, "n_predict": tokens, "stream": True,
                           "temperature": 0.0, "top_k": 1, "cache_prompt": True})
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port,
                                                timeout=TIMEOUT_S)
        try:
            connection.request("POST", "/completion", body,
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}")
            first = last = 0.0
            count = 0
            while line := response.readline():
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("content"):
                    first = first or now
                    last = now
                    count += 1
                if chunk.get("stop"):
                    break
        finally:
            connection.close()
        return (count - 1) / (last - first) if count > 1 and last > first else float("nan")

    def stop(self) -> None:
        self.server.stop()


# --- rounds -------------------------------------------------------------------------------


async def measure(side: DaemonSide | ServerSide, tokens: int) -> float:
    """One figure; NaN (left out of the medians) for a generation that ran past
    TIMEOUT_S (SFCORE_BENCH_TIMEOUT_S): a spinning llama.cpp beside heavy load can
    decode at 1 tok/s, and one such figure should not end the sitting."""
    try:
        if isinstance(side, DaemonSide):
            return await side.decode(tokens)
        return await asyncio.to_thread(side.decode, tokens)
    except TimeoutError:
        log(f"{side.label}: no reply within {TIMEOUT_S:.0f} s; figure left out")
        return float("nan")


async def rounds_of(sides: list[DaemonSide | ServerSide], loads: list[str], rounds: int,
                    tokens: int, workload_src: Path) -> dict[str, dict[str, list[float]]]:
    """samples[side label][load] = one figure per round; every load on every side,
    round by round, the side order alternating."""
    samples: dict[str, dict[str, list[float]]] = {
        side.label: {load: [] for load in loads} for side in sides}
    for side in sides:  # a first generation each: page faults, caches
        await measure(side, 16)
    for round_index in range(rounds):
        for load in loads:
            order = sides if (round_index % 2 == 0) else list(reversed(sides))
            with load_of(load, workload_src):
                for side in order:
                    value = await measure(side, tokens)
                    samples[side.label][load].append(value)
                    log(f"round {round_index + 1}/{rounds} {load:>10} {side.label}: "
                        f"{value:.1f} tok/s")
    return samples


def paired(top: list[float], bottom: list[float]) -> float:
    ratios = [a / b for a, b in zip(top, bottom, strict=True)
              if b and not (math.isnan(a) or math.isnan(b))]
    return statistics.median(ratios) if ratios else float("nan")


def cell(values: list[float]) -> str:
    stats = summary(values)
    return f"{stats['median']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"


# --- the modes ----------------------------------------------------------------------------


async def run_loads(params: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    loads = args.loads
    sides: list[DaemonSide | ServerSide] = [
        await DaemonSide.start(params, "daemon", None, args.adaptive != "off")]
    if args.llama_server:
        sides.append(ServerSide.start(args.llama_server, params, "llama-server",
                                      SPIN_VALUES.get(args.server_spin, args.server_spin)))
    try:
        samples = await rounds_of(sides, loads, args.rounds, args.tokens, args.workload_src)
        daemon = sides[0]
        assert isinstance(daemon, DaemonSide)
        threads = await daemon.threads()
    finally:
        await stop_all(sides)
    print(f"\n### Decode beside other work ({header(params, args)})\n")
    has_server = len(sides) > 1
    print("| load | daemon tok/s | daemon load/idle |"
          + (" llama-server tok/s | llama-server load/idle | daemon/llama-server |"
             if has_server else ""))
    print("|---|---|---|" + ("---|---|---|" if has_server else ""))
    checks = []
    for load in loads:
        d = samples["daemon"][load]
        row = f"| {load} | {cell(d)} | {paired(d, samples['daemon']['idle']):.2f} |"
        if has_server:
            s = samples["llama-server"][load]
            row += (f" {cell(s)} | {paired(s, samples['llama-server']['idle']):.2f} |"
                    f" {paired(d, s):.2f} |")
        print(row)
    if "busy1" in loads:
        kept = paired(samples["daemon"]["busy1"], samples["daemon"]["idle"])
        checks.append(("daemon beside 1 busy process >= 0.5 of idle", kept, kept >= 0.5))
        if has_server:
            lead = paired(samples["daemon"]["busy1"], samples["llama-server"]["busy1"])
            checks.append(("daemon beside 1 busy >= 1.3x llama-server beside 1 busy",
                           lead, lead >= 1.3))
    changes = [line.split(": ", 1)[-1] for line in daemon.log_text.splitlines()
               if "decoding with" in line]
    print(f"\nDaemon threads at the end: {threads}; its changes:")
    for line in changes[:12]:
        print(f"- {line}")
    print()
    for name, value, met in checks:
        print(f"- {name}: {value:.2f} {'met' if met else 'NOT met'}")
    return {"samples": samples, "threads": threads}


async def run_spin(params: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    values = args.spin
    sides: list[DaemonSide | ServerSide] = []
    try:
        for name in values:
            spin = SPIN_VALUES.get(name, name)
            sides.append(await DaemonSide.start(params, f"daemon {name}", spin,
                                                args.adaptive == "on"))
            if args.llama_server:
                sides.append(ServerSide.start(args.llama_server, params,
                                              f"llama-server {name}", spin))
        samples = await rounds_of(sides, ["idle", "busy1"], args.rounds, args.tokens,
                                  args.workload_src)
    finally:
        await stop_all(sides)
    print(f"\n### GOMP_SPINCOUNT sweep ({header(params, args)}; daemon adaptive threads "
          f"{'on' if args.adaptive == 'on' else 'off'})\n")
    print("| GOMP_SPINCOUNT | daemon idle | daemon 1 busy | ratio |"
          + (" llama-server idle | llama-server 1 busy | ratio |" if args.llama_server
             else ""))
    print("|---|---|---|---|" + ("---|---|---|" if args.llama_server else ""))
    for name in values:
        d = samples[f"daemon {name}"]
        row = f"| {name} | {cell(d['idle'])} | {cell(d['busy1'])} | " \
              f"{paired(d['busy1'], d['idle']):.2f} |"
        if args.llama_server:
            s = samples[f"llama-server {name}"]
            row += f" {cell(s['idle'])} | {cell(s['busy1'])} | " \
                   f"{paired(s['busy1'], s['idle']):.2f} |"
        print(row)
    return {"samples": samples}


async def run_idle_pair(params: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    sides: list[DaemonSide | ServerSide] = []
    try:
        sides.append(await DaemonSide.start(params, "now", None, True))
        sides.append(await DaemonSide.start(params, "before", LIBGOMP_DEFAULT, False))
        samples = await rounds_of(sides, ["idle"], args.rounds * 3, args.tokens,
                                  args.workload_src)
    finally:
        await stop_all(sides)
    now, before = samples["now"]["idle"], samples["before"]["idle"]
    ratio = paired(now, before)
    print(f"\n### Idle decode, paired ({header(params, args, args.rounds * 3)})\n")
    print("| daemon | tok/s |\n|---|---|")
    print(f"| as shipped (GOMP_SPINCOUNT default, adaptive threads) | {cell(now)} |")
    print(f"| before (GOMP_SPINCOUNT=300000, adaptive threads off) | {cell(before)} |")
    print(f"\n- now/before (median of paired ratios): {ratio:.3f} "
          f"{'met' if ratio >= 0.98 else 'NOT met'} (>= 0.98)")
    return {"samples": samples, "ratio": ratio}


async def stop_all(sides: list[DaemonSide | ServerSide]) -> None:
    for side in sides:
        with contextlib.suppress(Exception):
            if isinstance(side, DaemonSide):
                await side.stop()
            else:
                side.stop()


def header(params: dict[str, Any], args: argparse.Namespace, rounds: int = 0) -> str:
    return (f"{Path(params['model']).name}, threads {params['n_threads']}/"
            f"{params['n_threads_batch']}, {args.tokens} greedy tokens, medians (min-max) of "
            f"{rounds or args.rounds} rounds")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--contention-mode", choices=("loads", "spin", "idle-pair", "all"),
                       default="loads", help="contention: which measurement (default loads)")
    group.add_argument("--loads", default=",".join(LOADS),
                       help=f"contention: loads of the loads mode (default {','.join(LOADS)})")
    group.add_argument("--spin", default="0,1k,3k,10k,30k,100k,default",
                       help="contention: GOMP_SPINCOUNT values of the spin mode")
    group.add_argument("--server-spin", default=None,
                       help="contention: GOMP_SPINCOUNT for llama-server in the loads mode "
                            "(default: unset, libgomp's own)")
    group.add_argument("--adaptive", choices=("on", "off"), default=None,
                       help="contention: the daemon's adaptive threads (default: on in "
                            "loads, off in spin)")
    group.add_argument("--workload-src", type=Path,
                       help="contention: a C file the build load compiles in a loop "
                            "(default: a synthetic one)")


def check(args: argparse.Namespace) -> list[str]:
    loads = [load for load in args.loads.split(",") if load]
    unknown = sorted(set(loads) - set(LOADS))
    if unknown or "idle" not in loads:
        return [f"--loads: each one of {LOADS}, idle included"]
    return []


def run(bench: Bench) -> dict[str, Any]:
    """The section: the modes asked for, their tables; every sample for the JSON."""
    args = argparse.Namespace(**vars(bench.args))
    args.rounds = bench.runs
    args.mode = args.contention_mode
    args.loads = [load for load in args.loads.split(",") if load]
    args.spin = [value for value in args.spin.split(",") if value]
    params = {key: bench.params[key] for key in ("model", "n_ctx", "n_threads",
                                                 "n_threads_batch")}
    workdir = Path(tempfile.mkdtemp(prefix="sfbench-contention-"))
    try:
        if args.workload_src is None:
            args.workload_src = workdir / "work.c"
            args.workload_src.write_text(_SYNTHETIC_C + "\n")
        started = time.perf_counter()
        results: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens}
        modes = ("loads", "spin", "idle-pair") if args.mode == "all" else (args.mode,)
        runners = {"loads": run_loads, "spin": run_spin, "idle-pair": run_idle_pair}
        for mode in modes:
            results[mode] = bench.runner(runners[mode](params, args))
        log(f"[contention] done in {time.perf_counter() - started:.0f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results
