#!/usr/bin/env python3
"""The daemon against the llama.cpp ceiling, measured side by side in one run.

Each run starts three fresh processes on the same model, threads and prompts:

- the ceiling: llama.cpp driven in-process through llama-cpp-python's low-level C API
  and llama.cpp's C sampler chain, with the daemon's context settings, no daemon;
- the daemon, through its Unix socket, timed as a client sees it;
- a peer for reference: llama-cpp-python's high-level `Llama` (decode and first token).

With `--llama-bench PATH` (or LLAMA_BENCH=PATH) llama.cpp's own `llama-bench` runs too.
Every figure is the median of --runs runs, shown with its min-max and the ratio
daemon/ceiling; the full results, raw samples included, go to --json.

    .venv/bin/python scripts/bench.py [--runs 5] [--tokens 128] [--json bench_results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DECODE_PROMPT = "The history of the printing press begins"
SHORT_PROMPT = "Write a haiku about the sea."
CONCURRENT_PROMPTS = [
    "The history of the printing press begins",
    "A short guide to growing tomatoes:",
    "The main causes of the French Revolution were",
    "Here is a recipe for bread:",
]
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 42}
PREFILL_TOKENS = 512
PREFIX_TOKENS = 1000
QUESTIONS = ("\n\nQuestion: what is the first topic above?\nAnswer:",
             "\n\nQuestion: summarise the text above in one line.\nAnswer:")
FILLER_WORDS = """model token cache socket daemon river mountain garden library engine signal
window harbor lantern market paper thread kernel memory compass winter summer orbit valley
bridge castle forest desert ocean island quickly slowly carefully brightly quietly"""
TIMEOUT_S = 120.0
RSS_HEADROOM_MB = 100.0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def filler_text(n_words: int, seed: int) -> str:
    """Deterministic prose-like text: varied words, so it tokenizes like real input."""
    words = FILLER_WORDS.split()
    rng = random.Random(seed)
    sentences, count = [], 0
    while count < n_words:
        length = rng.randint(6, 14)
        sentence = " ".join(rng.choice(words) for _ in range(length))
        sentences.append(sentence.capitalize() + ".")
        count += length
    return " ".join(sentences)


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM in MB (10^6 bytes, like the model file size it is compared with)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


# --- the ceiling: llama.cpp's C API in this process -----------------------------------------


def ceiling_worker(params: dict[str, Any]) -> None:
    """Runs in a child process; prints "ready" once warmed up, then one JSON line."""
    from sfcore_daemon.config import ModelConfig
    from sfcore_daemon.engine import context_params
    from sfcore_daemon.llama_c import C

    kv_mib: list[float] = []

    def on_log(_level: int, text: bytes, _data: Any) -> None:
        line = text.decode(errors="replace")
        if line.startswith("llama_kv_cache: size ="):
            kv_mib.append(float(line.split("=")[1].split("MiB")[0]))

    callback = C.llama_log_callback(on_log)
    C.llama_log_set(callback, None)
    C.llama_backend_init()
    model_params = C.llama_model_default_params()
    model = C.llama_model_load_from_file(params["model"].encode(), model_params)
    config = ModelConfig(n_ctx=params["n_ctx"])
    ctx = C.llama_init_from_model(
        model, context_params(config, params["n_threads"], params["n_threads_batch"]))
    vocab = C.llama_model_get_vocab(model)
    memory = C.llama_get_memory(ctx)
    one = (C.llama_token * 1)()
    one_batch = C.llama_batch_get_one(one, 1)
    one[0] = C.llama_vocab_bos(vocab)
    C.llama_decode(ctx, one_batch)
    C.llama_memory_clear(memory, False)
    print("ready", flush=True)

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        buf = (C.llama_token * (len(data) + 8))()
        n = C.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
        return buf[:n]

    cached: list[int] = []

    def prefill(tokens: list[int], reuse: bool) -> None:
        n_keep = 0
        if reuse:
            limit = min(len(cached), len(tokens) - 1)
            while n_keep < limit and cached[n_keep] == tokens[n_keep]:
                n_keep += 1
        C.llama_memory_seq_rm(memory, 0, n_keep, -1)
        del cached[n_keep:]
        rest = (C.llama_token * (len(tokens) - n_keep))(*tokens[n_keep:])
        for start in range(0, len(rest), config.n_batch):
            chunk = rest[start:start + config.n_batch]
            array = (C.llama_token * len(chunk))(*chunk)
            C.llama_decode(ctx, C.llama_batch_get_one(array, len(chunk)))
        cached.extend(tokens)

    def sampler(sampled: bool) -> Any:
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if not sampled:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
            return chain
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(SAMPLED["top_k"]))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_p(SAMPLED["top_p"], 1))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_min_p(SAMPLED["min_p"], 1))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(SAMPLED["temperature"]))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(SAMPLED["seed"]))
        return chain

    def generate(prompt: list[int], n_tokens: int, sampled: bool = False,
                 reuse: bool = False) -> tuple[float, float, int]:
        """(first-token ms, decode tok/s, tokens) from the start of prompt evaluation."""
        chain = sampler(sampled)
        started = time.perf_counter()
        prefill(prompt, reuse)
        sample, decode, is_eog = C.llama_sampler_sample, C.llama_decode, C.llama_vocab_is_eog
        first = last = 0.0
        count = 0
        while True:
            token = sample(chain, ctx, -1)
            if is_eog(vocab, token):
                break
            last = time.perf_counter()
            if count == 0:
                first = last
            count += 1
            if count >= n_tokens:
                break
            one[0] = token
            decode(ctx, one_batch)
        C.llama_sampler_free(chain)
        rate = (count - 1) / (last - first) if count > 1 else float("nan")
        return (first - started) * 1e3, rate, count

    # Prompts of exact token counts, shared with the daemon's runs.
    prefill_text = fit_to_tokens(tokenize, PREFILL_TOKENS, seed=1)
    prefix_text = fit_to_tokens(tokenize, PREFIX_TOKENS, seed=2)
    tokens = params["tokens"]
    results: dict[str, Any] = {}
    _, results["decode_tok_s"], results["decode_tokens"] = generate(
        tokenize(DECODE_PROMPT), tokens)
    _, results["sampled_tok_s"], results["sampled_tokens"] = generate(
        tokenize(DECODE_PROMPT), tokens, sampled=True)
    first_ms, _, _ = generate(tokenize(prefill_text), 1)
    results["prefill_tok_s"] = len(tokenize(prefill_text)) / (first_ms / 1e3)
    results["first_token_short_ms"] = generate(tokenize(SHORT_PROMPT), 1)[0]
    prompt_a, prompt_b = (tokenize(prefix_text + question) for question in QUESTIONS)
    results["first_token_prefix_cold_ms"] = generate(prompt_b, 1)[0]
    generate(prompt_a, 1)
    results["first_token_prefix_cached_ms"] = generate(prompt_b, 1, reuse=True)[0]
    results["peak_rss_mb"] = peak_rss_mb()
    results["kv_mib"] = sum(kv_mib)
    results["prompts"] = {"prefill": prefill_text, "prefix": prefix_text}
    C.llama_free(ctx)
    C.llama_model_free(model)
    print(json.dumps(results), flush=True)


def fit_to_tokens(tokenize: Callable[[str], list[int]], target: int, seed: int) -> str:
    """The longest filler text with at most `target` tokens (BOS included)."""
    low, high = 1, target
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenize(filler_text(middle, seed))) <= target:
            low = middle
        else:
            high = middle - 1
    return filler_text(low, seed)


def run_ceiling(params: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, __file__, "--ceiling-worker", json.dumps(params)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    try:
        ready_line = process.stdout.readline()
        ready_ms = (time.perf_counter() - started) * 1e3
        if ready_line.strip() != "ready":
            raise RuntimeError("the ceiling worker failed to start")
        result: dict[str, Any] = json.loads(process.stdout.readline())
        process.wait(TIMEOUT_S)
    finally:
        process.kill()
    result["ready_ms"] = ready_ms
    return result


# --- the peer: llama-cpp-python's high-level API ------------------------------------------


PEER_CODE = """
import json, sys, time
params = json.loads(sys.argv[1])
from llama_cpp import Llama
llm = Llama(model_path=params["model"], n_ctx=params["n_ctx"], n_batch=512,
            n_threads=params["n_threads"], n_threads_batch=params["n_threads_batch"],
            flash_attn=True, verbose=False)
print("ready", flush=True)
stamps = []
started = time.perf_counter()
for _ in llm.create_completion(params["prompt"], max_tokens=params["tokens"], temperature=0.0,
                               stream=True):
    stamps.append(time.perf_counter())
print(json.dumps({"first_token_ms": (stamps[0] - started) * 1e3,
                  "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}))
"""


def run_peer(params: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", PEER_CODE, json.dumps({**params, "prompt": DECODE_PROMPT})],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError("llama-cpp-python's Llama failed to start")
        ready_ms = (time.perf_counter() - started) * 1e3
        result: dict[str, Any] = json.loads(process.stdout.readline())
        process.wait(TIMEOUT_S)
    finally:
        process.kill()
    result["ready_ms"] = ready_ms
    return result


# --- the daemon, through its socket -------------------------------------------------------


class Stream:
    """One NDJSON connection, with the arrival time of every reply line."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: str) -> Stream:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 22)
        return cls(reader, writer)

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request; return first-token ms, decode tok/s and the done line."""
        started = time.perf_counter()
        self.writer.write(json.dumps(request).encode() + b"\n")
        first = last = 0.0
        while True:
            line = await asyncio.wait_for(self.reader.readline(), TIMEOUT_S)
            now = time.perf_counter()
            reply = json.loads(line)
            if reply["type"] == "token":
                first = first or now
                last = now
            elif reply["type"] == "done":
                break
            else:
                raise RuntimeError(f"daemon answered {reply}")
        tokens = reply["usage"]["completion_tokens"]
        return {
            "first_token_ms": (first - started) * 1e3,
            "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first
            else float("nan"),
            "total_s": now - started,
            "done": reply,
        }

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def run_daemon(params: dict[str, Any], prompts: dict[str, str]) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sfbench-", dir="/tmp"))
    socket_path, notify_path = str(workdir / "s"), str(workdir / "n")
    config = workdir / "config.toml"
    config.write_text(f'[model]\npath = "{params["model"]}"\nn_ctx = {params["n_ctx"]}\n'
                      '[log]\nlevel = "warning"\n')
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.setblocking(False)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfcore_daemon", "--config", str(config), "--socket", socket_path,
        env={**os.environ, "NOTIFY_SOCKET": notify_path}, cwd=REPO,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while b"READY=1" not in await asyncio.wait_for(loop.sock_recv(notify, 4096), TIMEOUT_S):
            pass
        results: dict[str, Any] = {"ready_ms": (time.perf_counter() - started) * 1e3}
        await measure_daemon(socket_path, params, prompts, results)
        results["peak_rss_mb"] = peak_rss_mb(process.pid)
    finally:
        if process.returncode is None:
            process.terminate()
        _, stderr = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
        notify.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if process.returncode != 0:
        raise RuntimeError(f"the daemon exited with {process.returncode}: {stderr.decode()}")
    return results


async def measure_daemon(path: str, params: dict[str, Any], prompts: dict[str, str],
                         results: dict[str, Any]) -> None:
    tokens = params["tokens"]
    stream = await Stream.open(path)
    greedy = {"temperature": 0.0, "max_tokens": tokens}
    run = await stream.generate({"prompt": DECODE_PROMPT, **greedy})
    results["decode_tok_s"] = run["decode_tok_s"]
    results["decode_tokens"] = run["done"]["usage"]["completion_tokens"]
    run = await stream.generate({"prompt": DECODE_PROMPT, "max_tokens": tokens, **SAMPLED})
    results["sampled_tok_s"] = run["decode_tok_s"]
    results["sampled_tokens"] = run["done"]["usage"]["completion_tokens"]
    run = await stream.generate(
        {"prompt": prompts["prefill"], "max_tokens": 1, "cache_prompt": False})
    prompt_tokens = run["done"]["usage"]["prompt_tokens"]
    results["prefill_tok_s"] = prompt_tokens / (run["first_token_ms"] / 1e3)
    results["prefill_tok_s_daemon_reported"] = run["done"]["timings"]["prompt_tok_s"]
    run = await stream.generate({"prompt": SHORT_PROMPT, "max_tokens": 1, "cache_prompt": False})
    results["first_token_short_ms"] = run["first_token_ms"]
    prompt_a, prompt_b = (prompts["prefix"] + question for question in QUESTIONS)
    run = await stream.generate({"prompt": prompt_b, "max_tokens": 1, "cache_prompt": False})
    results["first_token_prefix_cold_ms"] = run["first_token_ms"]
    await stream.generate({"prompt": prompt_a, "max_tokens": 1})
    run = await stream.generate({"prompt": prompt_b, "max_tokens": 1})
    results["first_token_prefix_cached_ms"] = run["first_token_ms"]
    results["prefix_cached_tokens"] = run["done"]["usage"]["cached_tokens"]
    await stream.close()

    # One client alone, then four at once, on the same four prompts (end to end:
    # prompt evaluation included, as a client waiting for its answer sees it).
    async def one(prompt: str) -> tuple[int, float]:
        client = await Stream.open(path)
        run = await client.generate({"prompt": prompt, **greedy})
        await client.close()
        return run["done"]["usage"]["completion_tokens"], time.perf_counter()

    started = time.perf_counter()
    n_single, finished = await one(CONCURRENT_PROMPTS[1])
    results["single_client_tok_s"] = n_single / (finished - started)
    started = time.perf_counter()
    runs = await asyncio.gather(*(one(prompt) for prompt in CONCURRENT_PROMPTS))
    results["concurrent_4_tok_s"] = sum(n for n, _ in runs) / (
        max(t for _, t in runs) - started)


# --- llama-bench ------------------------------------------------------------------------------


def run_llama_bench(binary: str, params: dict[str, Any], runs: int) -> dict[str, float]:
    command = [binary, "-m", params["model"], "-t", str(params["n_threads"]),
               "-p", str(PREFILL_TOKENS), "-n", str(params["tokens"]), "-r", str(runs),
               "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, float] = {}
    for row in json.loads(out.stdout):
        key = "prefill_tok_s" if row.get("n_prompt", 0) > 0 else "decode_tok_s"
        result[key] = float(row["avg_ts"])
    return result


# --- the table --------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite)}


def cell(stats: dict[str, float] | None) -> str:
    if stats is None:
        return "-"
    return f"{stats['median']:.1f} ({stats['min']:.1f}-{stats['max']:.1f})"


ROWS = [  # key, label, unit
    ("decode_tok_s", "decode, greedy", "tok/s"),
    ("sampled_tok_s", "decode, sampled", "tok/s"),
    ("prefill_tok_s", f"prefill, {PREFILL_TOKENS}-token prompt", "tok/s"),
    ("first_token_short_ms", "first token, short cold prompt", "ms"),
    ("first_token_prefix_cold_ms", f"first token, {PREFIX_TOKENS}-token prompt, cold", "ms"),
    ("first_token_prefix_cached_ms", f"first token, same, {PREFIX_TOKENS}-token prefix cached",
     "ms"),
    ("ready_ms", "process start to ready", "ms"),
    ("single_client_tok_s", "1 client, end to end", "tok/s"),
    ("concurrent_4_tok_s", "4 concurrent clients, aggregate", "tok/s"),
    ("peak_rss_mb", "peak RSS", "MB"),
]


def targets(medians: dict[str, dict[str, float]], bound_mb: float,
            llama_bench: dict[str, float] | None) -> list[tuple[str, str, bool]]:
    daemon, ceiling = medians["daemon"], medians["ceiling"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    checks = [
        ("decode >= 0.97 x ceiling", ratio(daemon["decode_tok_s"], ceiling["decode_tok_s"]),
         0.97, True),
        ("prefill >= 0.95 x ceiling", ratio(daemon["prefill_tok_s"], ceiling["prefill_tok_s"]),
         0.95, True),
        ("sampled >= 0.95 x greedy", ratio(daemon["sampled_tok_s"], daemon["decode_tok_s"]),
         0.95, True),
        ("first token, short cold <= 60 ms", daemon["first_token_short_ms"], 60.0, False),
        ("cached prefix <= 1/10 of cold", ratio(daemon["first_token_prefix_cached_ms"],
                                                daemon["first_token_prefix_cold_ms"]), 0.1, False),
        ("ready <= 800 ms", daemon["ready_ms"], 800.0, False),
        ("4 clients >= 0.95 x 1 client", ratio(daemon["concurrent_4_tok_s"],
                                               daemon["single_client_tok_s"]), 0.95, True),
        (f"peak RSS <= {bound_mb:.0f} MB (model + KV + {RSS_HEADROOM_MB:.0f})",
         daemon["peak_rss_mb"], bound_mb, False),
    ]
    if llama_bench and "decode_tok_s" in llama_bench:
        checks.append(("decode >= 0.95 x llama-bench tg",
                       ratio(daemon["decode_tok_s"], llama_bench["decode_tok_s"]), 0.95, True))
    return [(label, f"{value:.3f}" if value < 10 else f"{value:.1f}",
             value >= limit if at_least else value <= limit)
            for label, value, limit, at_least in checks]


def print_table(stats: dict[str, dict[str, dict[str, float]]],
                llama_bench: dict[str, float] | None, checks: list[tuple[str, str, bool]],
                header: str) -> None:
    print(header)
    print()
    print("| figure | unit | ceiling (C API, in-process) | sfcore daemon (socket) "
          "| daemon/ceiling | llama-cpp-python Llama |")
    print("|---|---|---|---|---|---|")
    for key, label, unit in ROWS:
        ceiling, daemon, peer = (stats[side].get(key) for side in ("ceiling", "daemon", "peer"))
        ratio = (f"{daemon['median'] / ceiling['median']:.3f}"
                 if ceiling and daemon and ceiling["median"] else "-")
        print(f"| {label} | {unit} | {cell(ceiling)} | {cell(daemon)} | {ratio} | {cell(peer)} |")
    if llama_bench:
        for key, label in (("decode_tok_s", "llama-bench tg"), ("prefill_tok_s", "llama-bench pp")):
            if key in llama_bench:
                daemon = stats["daemon"][key]["median"]
                print(f"| {label}{params_note(key)} | tok/s | {llama_bench[key]:.1f} (avg) | "
                      f"{daemon:.1f} | {daemon / llama_bench[key]:.3f} | - |")
    print()
    print("| target | measured | met |")
    print("|---|---|---|")
    for label, value, met in checks:
        print(f"| {label} | {value} | {'yes' if met else 'NO'} |")


def params_note(key: str) -> str:
    return f" ({PREFILL_TOKENS})" if key == "prefill_tok_s" else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    parser.add_argument("--model", help="GGUF model (default: the embedded default model)")
    parser.add_argument("--n-ctx", type=int, default=8192, help="context length (default 8192)")
    parser.add_argument("--json", default="bench_results.json", help="where to write results")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-cpp-python's Llama")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                        help="path of llama.cpp's llama-bench (default: $LLAMA_BENCH)")
    parser.add_argument("--ceiling-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ceiling_worker:
        ceiling_worker(json.loads(args.ceiling_worker))
        return 0

    from sfcore_daemon import cpus, models

    pinned = cpus.pin(())
    n_threads, n_threads_batch = cpus.derive_threads(pinned, 0, 0)
    model = models.resolve_model_path(args.model or "")
    params = {"model": model, "n_ctx": args.n_ctx, "n_threads": n_threads,
              "n_threads_batch": n_threads_batch, "tokens": args.tokens}
    header = (f"model {Path(model).name} ({os.path.getsize(model) / 1e6:.1f} MB), "
              f"CPUs {pinned}, threads {n_threads}/{n_threads_batch} (decode/batch), "
              f"n_ctx {args.n_ctx}, {args.tokens} decode tokens, medians (min-max) of "
              f"{args.runs} runs")
    log(f"bench: {header}")
    samples: dict[str, list[dict[str, Any]]] = {"ceiling": [], "daemon": [], "peer": []}
    started = time.perf_counter()
    for index in range(args.runs):
        log(f"[run {index + 1}/{args.runs}] ceiling (C API, in-process) ...")
        ceiling = run_ceiling(params)
        samples["ceiling"].append(ceiling)
        log(f"  ready {ceiling['ready_ms']:.0f} ms, decode {ceiling['decode_tok_s']:.1f} tok/s, "
            f"prefill {ceiling['prefill_tok_s']:.1f} tok/s")
        log(f"[run {index + 1}/{args.runs}] daemon (socket) ...")
        daemon = asyncio.run(run_daemon(params, ceiling["prompts"]))
        samples["daemon"].append(daemon)
        log(f"  ready {daemon['ready_ms']:.0f} ms, decode {daemon['decode_tok_s']:.1f} tok/s, "
            f"prefill {daemon['prefill_tok_s']:.1f} tok/s, 4 clients "
            f"{daemon['concurrent_4_tok_s']:.1f} tok/s")
        if not args.no_peer:
            log(f"[run {index + 1}/{args.runs}] llama-cpp-python Llama ...")
            peer = run_peer(params)
            samples["peer"].append(peer)
            log(f"  decode {peer['decode_tok_s']:.1f} tok/s")
    llama_bench = None
    if args.llama_bench:
        log(f"llama-bench ({args.llama_bench}) ...")
        llama_bench = run_llama_bench(args.llama_bench, params, args.runs)

    stats = {side: {key: summary([run[key] for run in runs])
                    for key, _, _ in ROWS if runs and key in runs[0]}
             for side, runs in samples.items()}
    kv_mb = samples["ceiling"][0]["kv_mib"] * 1.048576
    bound_mb = os.path.getsize(model) / 1e6 + kv_mb + RSS_HEADROOM_MB
    medians = {side: {key: value["median"] for key, value in figures.items()}
               for side, figures in stats.items()}
    checks = targets(medians, bound_mb, llama_bench)
    print_table(stats, llama_bench, checks, header)
    elapsed = time.perf_counter() - started
    for run in samples["ceiling"]:
        run.pop("prompts", None)
    Path(args.json).write_text(json.dumps({
        "params": params, "runs": args.runs, "samples": samples, "stats": stats,
        "llama_bench": llama_bench, "kv_mb": kv_mb, "rss_bound_mb": bound_mb,
        "targets": [{"target": label, "measured": value, "met": met}
                    for label, value, met in checks],
        "elapsed_s": elapsed}, indent=2))
    log(f"bench: {elapsed:.0f} s; results in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
