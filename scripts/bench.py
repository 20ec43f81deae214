#!/usr/bin/env python3
"""The daemon against the llama.cpp ceiling, measured side by side in one run.

Each run starts fresh processes on the same model, threads and prompts:

- the ceiling: llama.cpp driven in a process of its own through llama-cpp-python's
  low-level C API and llama.cpp's C sampler chain, with the daemon's context settings;
- the daemon, through its Unix socket, timed as a client sees it;
- a peer for reference: llama-cpp-python's high-level `Llama` (decode and first token).

The ceiling and the daemon are up together, idle but for the one being measured, and
each figure is taken on one right after the other (who goes first alternates by run),
so a noisy moment on a shared machine hits both sides, not one.

With `--llama-bench PATH` (or LLAMA_BENCH=PATH) llama.cpp's own `llama-bench` runs too.
Every figure is the median of --runs runs, shown with its min-max; ratios are the
median of the per-run ratios (each pair measured back to back). The full results, raw
samples included, go to --json. Both sides first evaluate one unmeasured long prompt:
the first 512-token batch after start also pays ~25 MB of first-touch page faults in
llama.cpp's compute buffer.

A second section, in scripts/bench_concurrency.py, measures 1, 2, 4 and 8 concurrent
clients on the daemon (`--slots N` sets its `[server] slots`), on llama-server
(`--llama-server PATH` or LLAMA_SERVER) and on llama-batched-bench (`--llama-batched-bench
PATH` or LLAMA_BATCHED_BENCH), plus the daemon's first token and inter-token gaps under
load. `--only figures` or `--only concurrency` runs one section. `--only cache` runs the
prompt-cache section (scripts/bench_cache.py; llama-server's --cache-ram beside it).
`--only openai` runs the OpenAI-endpoint section (scripts/bench_openai.py): one client's
decode and first token through /v1/chat/completions, NDJSON chat and llama-server.
`--only tools` runs the tool-call section (scripts/bench_tools.py, `--seeds N`): how many
forced calls validate, on the daemon and on llama-server. `--only forced` runs the
forced-drafts section (scripts/bench_forced.py): constrained decode on four schemas (six
prompts) with and without forced drafts, against the same prompts' free decode.

    .venv/bin/python scripts/bench.py [--runs 5] [--tokens 128] [--json bench_results.json]
    .venv/bin/python scripts/bench.py --only concurrency --runs 3 [--slots 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import uvloop
from benchlib import (
    REPO,
    SAMPLED,
    SHORT_PROMPT,
    TIMEOUT_S,
    Daemon,
    Stream,
    cell,
    filler_text,
    generation_figures,
    log,
    paired_ratio,
    summary,
)

sys.path.insert(0, str(REPO))

DECODE_PROMPT = "The history of the printing press begins"
CONCURRENT_PROMPTS = [
    "The history of the printing press begins",
    "A short guide to growing tomatoes:",
    "The main causes of the French Revolution were",
    "Here is a recipe for bread:",
]
PREFILL_TOKENS = 512
PREFIX_TOKENS = 1000
QUESTIONS = ("\n\nQuestion: what is the first topic above?\nAnswer:",
             "\n\nQuestion: summarise the text above in one line.\nAnswer:")
RSS_HEADROOM_MB = 100.0


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM in MB (10^6 bytes, like the model file size it is compared with)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


# --- the ceiling: llama.cpp's C API in a process of its own ---------------------------------


def ceiling_worker(params: dict[str, Any]) -> None:
    """The child process: prints "ready" once warmed up, then answers one JSON
    command per stdin line with one JSON line, until stdin closes."""
    from sfcore_daemon.config import ModelConfig
    from sfcore_daemon.llama.capi import C
    from sfcore_daemon.llama.model import context_params

    kv_mib: list[float] = []

    def on_log(_level: int, text: bytes, _data: Any) -> None:
        line = text.decode(errors="replace")
        if line.startswith("llama_kv_cache: size ="):
            kv_mib.append(float(line.split("=")[1].split("MiB")[0]))

    callback = C.llama_log_callback(on_log)
    C.llama_log_set(callback, None)
    C.llama_backend_init()
    model = C.llama_model_load_from_file(params["model"].encode(),
                                         C.llama_model_default_params())
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

    def prefill(tokens: list[int], reuse: bool) -> int:
        n_keep = 0
        if reuse:
            limit = min(len(cached), len(tokens) - 1)
            while n_keep < limit and cached[n_keep] == tokens[n_keep]:
                n_keep += 1
        C.llama_memory_seq_rm(memory, 0, n_keep, -1)
        del cached[n_keep:]
        for start in range(n_keep, len(tokens), config.n_batch):
            chunk = tokens[start:start + config.n_batch]
            array = (C.llama_token * len(chunk))(*chunk)
            C.llama_decode(ctx, C.llama_batch_get_one(array, len(chunk)))
        cached.extend(tokens)
        return n_keep

    def sampler(sampled: bool) -> Any:
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        add = C.llama_sampler_chain_add
        if not sampled:  # the daemon's greedy chain (repeat penalty off)
            add(chain, C.llama_sampler_init_top_k(1))
            add(chain, C.llama_sampler_init_greedy())
            return chain
        add(chain, C.llama_sampler_init_top_k(SAMPLED["top_k"]))
        add(chain, C.llama_sampler_init_top_p(SAMPLED["top_p"], 1))
        add(chain, C.llama_sampler_init_min_p(SAMPLED["min_p"], 1))
        add(chain, C.llama_sampler_init_temp(SAMPLED["temperature"]))
        add(chain, C.llama_sampler_init_dist(SAMPLED["seed"]))
        return chain

    def generate(text: str, tokens: int, sampled: bool, cache: bool) -> dict[str, Any]:
        prompt = tokenize(text)
        chain = sampler(sampled)
        started = time.perf_counter()
        n_cached = prefill(prompt, cache)
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
            if count >= tokens:
                break
            one[0] = token
            decode(ctx, one_batch)
            cached.append(token)
        C.llama_sampler_free(chain)
        return generation_figures(started, first or time.perf_counter(), last, count,
                                  prompt_tokens=len(prompt), cached_tokens=n_cached)

    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "generate":
            reply = generate(command["text"], command["tokens"], command["sampled"],
                             command["cache"])
        elif command["op"] == "prompts":  # texts of exact token counts, for both sides
            reply = {"prefill": fit_to_tokens(tokenize, PREFILL_TOKENS, seed=1),
                     "prefix": fit_to_tokens(tokenize, PREFIX_TOKENS, seed=2)}
        else:
            reply = {"peak_rss_mb": peak_rss_mb(), "kv_mib": sum(kv_mib)}
        print(json.dumps(reply), flush=True)
    C.llama_free(ctx)
    C.llama_model_free(model)


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


class Ceiling:
    """The parent's handle on a ceiling worker."""

    def __init__(self, process: asyncio.subprocess.Process, ready_ms: float) -> None:
        self.process, self.ready_ms = process, ready_ms

    @classmethod
    async def start(cls, params: dict[str, Any]) -> Ceiling:
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--ceiling-worker", json.dumps(params), cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ceiling = cls(process, 0.0)
        if await ceiling._line() != "ready":
            raise RuntimeError("the ceiling worker failed to start")
        ceiling.ready_ms = (time.perf_counter() - started) * 1e3
        return ceiling

    async def _line(self) -> str:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), TIMEOUT_S)
        return line.decode().strip()

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        reply: dict[str, Any] = json.loads(await self._line())
        return reply

    async def generate(self, text: str, tokens: int, sampled: bool = False,
                       cache: bool = True) -> dict[str, Any]:
        return await self.call("generate", text=text, tokens=tokens, sampled=sampled,
                               cache=cache)

    async def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        await asyncio.wait_for(self.process.wait(), TIMEOUT_S)


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


# --- one run: both sides up, each figure measured on one side right after the other ----------


Side = Any  # a Ceiling or a Stream: both have generate(text, tokens, sampled, cache)


Step = Callable[[Side], Coroutine[Any, Any, dict[str, Any]]]


def figure_steps(tokens: int, prompts: dict[str, str]) -> list[Step]:
    """The figures both sides have; each step leaves nothing behind that the next needs."""
    prompt_a, prompt_b = (prompts["prefix"] + question for question in QUESTIONS)

    async def decode(side: Side) -> dict[str, Any]:
        run = await side.generate(DECODE_PROMPT, tokens)
        return {"decode_tok_s": run["decode_tok_s"], "decode_tokens": run["tokens"]}

    async def sampled(side: Side) -> dict[str, Any]:
        run = await side.generate(DECODE_PROMPT, tokens, sampled=True)
        return {"sampled_tok_s": run["decode_tok_s"], "sampled_tokens": run["tokens"]}

    async def prefill(side: Side) -> dict[str, Any]:
        run = await side.generate(prompts["prefill"], 1, cache=False)
        return {"prefill_tok_s": run["prompt_tokens"] / (run["first_token_ms"] / 1e3)}

    async def short(side: Side) -> dict[str, Any]:
        run = await side.generate(SHORT_PROMPT, 1, cache=False)
        return {"first_token_short_ms": run["first_token_ms"]}

    async def prefix(side: Side) -> dict[str, Any]:
        cold = await side.generate(prompt_b, 1, cache=False)
        await side.generate(prompt_a, 1)
        cached = await side.generate(prompt_b, 1)
        return {"first_token_prefix_cold_ms": cold["first_token_ms"],
                "first_token_prefix_cached_ms": cached["first_token_ms"],
                "prefix_cached_tokens": cached["cached_tokens"]}

    return [decode, sampled, prefill, short, prefix]


async def measure_concurrency(path: str, tokens: int) -> dict[str, float]:
    """One client alone, then four at once, on the same prompts, end to end."""

    async def one(prompt: str) -> tuple[int, float]:
        client = await Stream.open(path)
        run = await client.generate(prompt, tokens)
        await client.close()
        return run["tokens"], time.perf_counter()

    started = time.perf_counter()
    n_single, finished = await one(CONCURRENT_PROMPTS[1])
    single = n_single / (finished - started)
    started = time.perf_counter()
    runs = await asyncio.gather(*(one(prompt) for prompt in CONCURRENT_PROMPTS))
    aggregate = sum(n for n, _ in runs) / (max(t for _, t in runs) - started)
    return {"single_client_tok_s": single, "concurrent_4_tok_s": aggregate}


async def one_run(params: dict[str, Any], daemon_first: bool) -> tuple[dict[str, Any],
                                                                        dict[str, Any]]:
    """Both sides up at once and measured figure by figure, one right after the other,
    so that a noisy moment on the machine hits both; who goes first alternates.

    Start-up is timed with each side alone: here a process loading the model while
    another one has it mapped took 200-250 ms longer (medians of 6: 875-953 ms
    against 663-720 ms), whichever process it was."""
    ready_ms = {}
    for name in ("daemon", "ceiling") if daemon_first else ("ceiling", "daemon"):
        alone = await (Daemon if name == "daemon" else Ceiling).start(params)
        ready_ms[name] = alone.ready_ms
        await alone.stop()
    ceiling = await Ceiling.start(params)
    daemon = await Daemon.start(params)
    stream = await Stream.open(daemon.socket_path)
    try:
        prompts = await ceiling.call("prompts")
        warm_up = filler_text(PREFILL_TOKENS, seed=3)
        sides: list[tuple[str, Side]] = [("ceiling", ceiling), ("daemon", stream)]
        if daemon_first:
            sides.reverse()
        results: dict[str, dict[str, Any]] = {"ceiling": {}, "daemon": {}}
        for _, side in sides:
            await side.generate(warm_up, 1)
        decode, sampled, *others = figure_steps(params["tokens"], prompts)
        # The decode figures twice, in A-B-B-A order, each run's value the mean of the
        # two: the target ratios (0.97, 0.95) are finer than this machine's noise.
        twice: dict[str, dict[str, list[float]]] = {"ceiling": {}, "daemon": {}}
        for order in (sides, sides[::-1]):
            for step in (decode, sampled):
                for name, side in order:
                    for key, value in (await step(side)).items():
                        twice[name].setdefault(key, []).append(value)
        for name, figures in twice.items():
            results[name].update({key: statistics.fmean(values)
                                  for key, values in figures.items()})
        for step in others:
            for name, side in sides:
                results[name].update(await step(side))
        for name, figures in results.items():
            log(f"  {name}: decode {figures['decode_tok_s']:.1f} tok/s, prefill "
                f"{figures['prefill_tok_s']:.1f} tok/s, first token "
                f"{figures['first_token_short_ms']:.1f} ms")
        results["daemon"].update(await measure_concurrency(daemon.socket_path,
                                                           params["tokens"]))
        results["ceiling"].update(await ceiling.call("rss"))
        results["daemon"]["peak_rss_mb"] = peak_rss_mb(daemon.process.pid)
        for name, value in ready_ms.items():
            results[name]["ready_ms"] = value
    finally:
        await stream.close()
        await daemon.stop()
        await ceiling.stop()
    return results["ceiling"], results["daemon"]


# --- structured output: constrained decode against unconstrained, same prompt, same run ------


STRUCTURED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 32},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"],
                },
            },
            "required": ["name", "tier", "address"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "maxLength": 12},
                               "qty": {"type": "integer"},
                               "price": {"type": "number"}},
                "required": ["sku", "qty", "price"],
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "total": {"type": "number"},
    },
    "required": ["order_id", "status", "customer", "items", "total"],
}
STRUCTURED_PROMPT = (
    "Orders as JSON, one per line.\n"
    '{"order_id": 1041, "status": "paid", "customer": {"name": "Ada Lovelace", "tier": "pro", '
    '"address": {"city": "London", "zip": "NW1 6XE"}}, "items": [{"sku": "BK-0042", "qty": 2, '
    '"price": 12.5}, {"sku": "PN-0007", "qty": 1, "price": 3.99}], "total": 28.99}\n'
    '{"order_id": 1042, "status": "shipped", "customer": {"name": "Alan Turing", "tier": '
    '"enterprise", "address": {"city": "Manchester", "zip": "M13 9PL"}}, "items": [{"sku": '
    '"CP-1100", "qty": 4, "price": 7.25}], "total": 29.0}\n')
STRUCTURED_MAX_TOKENS = 200
# llama-cpp-python's Llama runs the grammar over the whole vocabulary every token (up to
# a second or more each here): its figure comes from a shorter run.
STRUCTURED_PEER_TOKENS = 32

STRUCTURED_PEER_CODE = """
import json, sys, time
params = json.loads(sys.argv[1])
from llama_cpp import Llama, LlamaGrammar
llm = Llama(model_path=params["model"], n_ctx=params["n_ctx"], n_batch=512,
            n_threads=params["n_threads"], n_threads_batch=params["n_threads_batch"],
            flash_attn=True, verbose=False)
grammar = LlamaGrammar.from_string(params["grammar"], verbose=False)
stamps, text = [], []
for chunk in llm.create_completion(params["prompt"], max_tokens=params["tokens"],
                                   grammar=grammar, stream=True, **params["sampling"]):
    stamps.append(time.perf_counter())
    text.append(chunk["choices"][0]["text"])
print(json.dumps({"decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  "tokens": len(stamps), "text": "".join(text)}))
"""


async def _stats(stream: Stream) -> dict[str, Any]:
    stream.writer.write(b'{"op": "stats"}\n')
    reply: dict[str, Any] = json.loads(await asyncio.wait_for(stream.reader.readline(),
                                                               TIMEOUT_S))
    return reply


async def structured_run(params: dict[str, Any]) -> dict[str, Any]:
    """One daemon; constrained (json_schema) and unconstrained decode of the same prompt
    with the same sampling, three times in A-B-B-A order (each side's figure the mean
    of its six); the slow-path share from `stats`."""
    daemon = await Daemon.start(params)
    stream = await Stream.open(daemon.socket_path)
    # One token a step on both sides: this measures what the grammar costs; drafts pay
    # differently on free text and on a document (the speculative section has them).
    sampling = {**SAMPLED, "stream": True, "speculative": False}
    constrained = {"prompt": STRUCTURED_PROMPT, "json_schema": STRUCTURED_SCHEMA,
                   "max_tokens": STRUCTURED_MAX_TOKENS, **sampling}
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    try:
        await stream.request({**constrained, "max_tokens": 8})  # warm-up (and the cache)
        before = (await _stats(stream))["grammar"]
        tokens = STRUCTURED_MAX_TOKENS
        for kind in ("constrained", "unconstrained", "unconstrained", "constrained") * 3:
            if kind == "constrained":
                run = await stream.request(constrained)
                if run["done"]["finish_reason"] != "stop":
                    raise RuntimeError(f"the constrained document did not end: {run['done']}")
                tokens = run["tokens"]
            else:
                # The same prompt and sampling, as many tokens as the document took.
                run = await stream.request({**constrained, "json_schema": None,
                                            "max_tokens": tokens})
            rates[kind].append(run["decode_tok_s"])
        after = (await _stats(stream))["grammar"]
    finally:
        await stream.close()
        await daemon.stop()
    checked = after["tokens"] - before["tokens"]
    return {"constrained_tok_s": statistics.fmean(rates["constrained"]),
            "unconstrained_tok_s": statistics.fmean(rates["unconstrained"]),
            "constrained_tokens": tokens,
            "slow_path_share": (after["resampled"] - before["resampled"]) / max(checked, 1)}


def structured_peer(params: dict[str, Any]) -> dict[str, Any]:
    from sfcore_daemon.structured.compiler import schema_to_gbnf

    peer_params = {**params, "prompt": STRUCTURED_PROMPT, "tokens": STRUCTURED_PEER_TOKENS,
                   "grammar": schema_to_gbnf(STRUCTURED_SCHEMA),
                   "sampling": {key: value for key, value in SAMPLED.items()}}
    out = subprocess.run([sys.executable, "-c", STRUCTURED_PEER_CODE, json.dumps(peer_params)],
                         capture_output=True, text=True, check=True, timeout=1800)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run_structured(params: dict[str, Any], runs: int, peer: bool) -> dict[str, Any]:
    """The structured-output section: every run measures the daemon both ways, then (with
    the peer) llama-cpp-python's Llama with the same grammar, right after."""
    samples: list[dict[str, Any]] = []
    for index in range(runs):
        log(f"[structured {index + 1}/{runs}] daemon, constrained and unconstrained ...")
        sample = uvloop.run(structured_run(params))
        log(f"  constrained {sample['constrained_tok_s']:.1f} tok/s, unconstrained "
            f"{sample['unconstrained_tok_s']:.1f} tok/s, slow path "
            f"{100 * sample['slow_path_share']:.1f}% of {sample['constrained_tokens']} tokens")
        if peer:
            log(f"[structured {index + 1}/{runs}] llama-cpp-python Llama with the grammar ...")
            peer_result = structured_peer(params)
            sample["peer_constrained_tok_s"] = peer_result["decode_tok_s"]
            log(f"  Llama constrained {peer_result['decode_tok_s']:.2f} tok/s")
        samples.append(sample)
    return {"samples": samples}


def print_structured(section: dict[str, Any]) -> list[tuple[str, float, bool]]:
    samples = section["samples"]

    def stats(key: str) -> dict[str, float] | None:
        return summary([s[key] for s in samples]) if key in samples[0] else None

    ratio = paired_ratio(samples, "constrained_tok_s", samples, "unconstrained_tok_s")
    share = summary([100 * s["slow_path_share"] for s in samples])
    peer = stats("peer_constrained_tok_s")
    peer_ratio = (paired_ratio(samples, "constrained_tok_s", samples, "peer_constrained_tok_s")
                  if peer else float("nan"))
    print()
    print("Structured output (json_schema: nested objects, arrays, enums, numbers; "
          f"sampled, {samples[0]['constrained_tokens']}-token document):")
    print()
    print("| figure | unit | sfcore daemon | llama-cpp-python Llama, same grammar | "
          "daemon/Llama (paired) |")
    print("|---|---|---|---|---|")
    print(f"| constrained decode | tok/s | {cell(stats('constrained_tok_s'))} | {cell(peer)} | "
          f"{'-' if math.isnan(peer_ratio) else f'{peer_ratio:.1f}'} |")
    print(f"| unconstrained decode, same prompt | tok/s | "
          f"{cell(stats('unconstrained_tok_s'))} | - | - |")
    print(f"| constrained / unconstrained (paired) | ratio | {ratio:.3f} | - | - |")
    print(f"| tokens that needed the slow path | % | {cell(share)} | - | - |")
    return [("constrained >= 0.90 x unconstrained", ratio, ratio >= 0.90)]


# --- llama-bench ------------------------------------------------------------------------------


def run_llama_bench(binary: str, params: dict[str, Any]) -> dict[str, float]:
    command = [binary, "-m", params["model"], "-t", str(params["n_threads"]),
               "-p", str(PREFILL_TOKENS), "-n", str(params["tokens"]), "-r", "1",
               "-o", "json"]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    result: dict[str, float] = {}
    for row in json.loads(out.stdout):
        key = "prefill_tok_s" if row.get("n_prompt", 0) > 0 else "decode_tok_s"
        result[key] = float(row["avg_ts"])
    return result


# --- the table --------------------------------------------------------------------------------


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


def targets(samples: dict[str, list[dict[str, Any]]], medians: dict[str, dict[str, float]],
            bound_mb: float) -> list[tuple[str, float, bool]]:
    daemon, ceiling = samples["daemon"], samples["ceiling"]
    checks = [
        ("decode >= 0.97 x ceiling",
         paired_ratio(daemon, "decode_tok_s", ceiling, "decode_tok_s"), 0.97, True),
        ("prefill >= 0.95 x ceiling",
         paired_ratio(daemon, "prefill_tok_s", ceiling, "prefill_tok_s"), 0.95, True),
        ("sampled >= 0.95 x greedy",
         paired_ratio(daemon, "sampled_tok_s", daemon, "decode_tok_s"), 0.95, True),
        ("first token, short cold <= 60 ms", medians["daemon"]["first_token_short_ms"], 60.0,
         False),
        ("cached prefix <= 1/10 of cold", paired_ratio(
            daemon, "first_token_prefix_cached_ms", daemon, "first_token_prefix_cold_ms"),
         0.1, False),
        ("ready <= 800 ms", medians["daemon"]["ready_ms"], 800.0, False),
        ("4 clients >= 0.95 x 1 client",
         paired_ratio(daemon, "concurrent_4_tok_s", daemon, "single_client_tok_s"), 0.95, True),
        (f"peak RSS <= {bound_mb:.0f} MB (model + KV + {RSS_HEADROOM_MB:.0f})",
         medians["daemon"]["peak_rss_mb"], bound_mb, False),
    ]
    if samples["llama-bench"]:
        checks.append(("decode >= 0.95 x llama-bench tg", paired_ratio(
            daemon, "decode_tok_s", samples["llama-bench"], "decode_tok_s"), 0.95, True))
    return [(label, value, value >= limit if at_least else value <= limit)
            for label, value, limit, at_least in checks]


def print_table(samples: dict[str, list[dict[str, Any]]],
                stats: dict[str, dict[str, dict[str, float]]],
                checks: list[tuple[str, float, bool]],
                header: str) -> None:
    print(header)
    print()
    print("| figure | unit | ceiling (C API, own process) | sfcore daemon (socket) "
          "| daemon/ceiling (paired) | llama-cpp-python Llama |")
    print("|---|---|---|---|---|---|")
    for key, label, unit in ROWS:
        ceiling, daemon, peer = (stats[side].get(key) for side in ("ceiling", "daemon", "peer"))
        ratio = (f"{paired_ratio(samples['daemon'], key, samples['ceiling'], key):.3f}"
                 if ceiling and daemon else "-")
        print(f"| {label} | {unit} | {cell(ceiling)} | {cell(daemon)} | {ratio} | {cell(peer)} |")
    if samples["llama-bench"]:
        for key, label in (("decode_tok_s", "llama-bench tg"), ("prefill_tok_s", "llama-bench pp")):
            paired = paired_ratio(samples["daemon"], key, samples["llama-bench"], key)
            print(f"| {label}{params_note(key)} | tok/s | {cell(stats['llama-bench'][key])} | "
                  f"{cell(stats['daemon'][key])} | {paired:.3f} | - |")
    print_targets(checks)


def print_targets(checks: list[tuple[str, float, bool]]) -> None:
    print()
    print("| target | measured | met |")
    print("|---|---|---|")
    for label, value, met in checks:
        shown = f"{value:.3f}" if value < 10 else f"{value:.1f}"
        print(f"| {label} | {shown} | {'yes' if met else 'NO'} |")


def params_note(key: str) -> str:
    return f" ({PREFILL_TOKENS})" if key == "prefill_tok_s" else ""


def concurrency_module() -> Any:
    """scripts/bench_concurrency.py (imported on use: the other sections do not need it)."""
    import bench_concurrency

    return bench_concurrency


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per run")
    parser.add_argument("--model", help="GGUF model (default: the embedded default model)")
    parser.add_argument("--n-ctx", type=int, default=8192,
                        help="[model] n_ctx of the daemon (default 8192)")
    parser.add_argument("--json", default="bench_results.json", help="where to write results")
    parser.add_argument("--no-peer", action="store_true", help="skip llama-cpp-python's Llama")
    parser.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                        help="path of llama.cpp's llama-bench (default: $LLAMA_BENCH)")
    parser.add_argument("--only", choices=("figures", "concurrency", "structured",
                                           "speculative", "cache", "openai", "tools",
                                           "forced"),
                        help="run one section: the single-client figures, the concurrent "
                             "clients or structured output (default: all)")
    parser.add_argument("--slots", type=int,
                        help="write [server] slots = N into every daemon's config "
                             "(default: not set, the daemon's own default)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="path of llama.cpp's llama-server, measured in the concurrency "
                             "section (default: $LLAMA_SERVER)")
    parser.add_argument("--llama-batched-bench", default=os.environ.get("LLAMA_BATCHED_BENCH"),
                        help="path of llama.cpp's llama-batched-bench, run in the concurrency "
                             "section (default: $LLAMA_BATCHED_BENCH)")
    parser.add_argument("--llama-server-kv", choices=("split", "unified"), default="split",
                        help="llama-server's KV cache: split (default): -c n_ctx x -np, "
                             "n_ctx cells for each slot; unified: -kvu -c n_ctx, one pool of "
                             "n_ctx cells shared by the slots, as in the daemon")
    parser.add_argument("--only-structured", action="store_true",
                        help="the same as --only structured")
    parser.add_argument("--no-structured", action="store_true",
                        help="skip the structured-output section when running all")
    parser.add_argument("--churn-rounds", type=int, default=3,
                        help="measured rounds of the cache section's churn (default 3)")
    parser.add_argument("--seeds", type=int, default=20,
                        help="seeds per prompt and row of the tools section (default 20)")
    parser.add_argument("--ceiling-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ceiling_worker:
        ceiling_worker(json.loads(args.ceiling_worker))
        return 0
    if args.slots is not None and args.slots < 1:
        parser.error("--slots must be at least 1")
    if args.only_structured:
        args.only = "structured"
    figures = args.only in (None, "figures")
    structured = args.only == "structured" or (args.only is None and not args.no_structured)
    concurrency = concurrency_module() if args.only in (None, "concurrency") else None
    if concurrency is not None:
        problems = concurrency.peer_paths(args.llama_server, args.llama_batched_bench)
        if problems:
            parser.error("; ".join(problems))

    from sfcore_daemon.llama import modelfile
    from sfcore_daemon.system import cpus

    pinned = cpus.pin(())
    n_threads, n_threads_batch = cpus.derive_threads(pinned, 0, 0)
    model = modelfile.resolve_model_path(args.model or "")
    params = {"model": model, "n_ctx": args.n_ctx, "n_threads": n_threads,
              "n_threads_batch": n_threads_batch, "tokens": args.tokens, "slots": args.slots,
              "llama_server_kv": args.llama_server_kv}
    slots = f", daemon slots {args.slots}" if args.slots else ""
    header = (f"model {Path(model).name} ({os.path.getsize(model) / 1e6:.1f} MB), "
              f"CPUs {pinned}, threads {n_threads}/{n_threads_batch} (decode/batch), "
              f"n_ctx {args.n_ctx}{slots}, {args.tokens} decode tokens, medians (min-max) of "
              f"{args.runs} runs")
    log(f"bench: {header}")
    started = time.perf_counter()
    results: dict[str, Any] = {"params": params, "runs": args.runs}
    if figures:
        results.update(run_figures(args, params, header))
    if structured:
        if figures:
            print()
        section = run_structured(params, args.runs, not args.no_peer)
        print(header)
        structured_checks = print_structured(section)
        print_targets(structured_checks)
        results["structured"] = {"section": section, "targets": [
            {"target": label, "measured": value, "met": met}
            for label, value, met in structured_checks]}
    if args.only == "speculative":
        results["speculative"] = run_speculative(params, args.runs, args.llama_server, header)
    if args.only == "cache":
        import bench_cache

        results["cache"] = bench_cache.run(params, args.runs, args.llama_server,
                                           args.churn_rounds, runner=uvloop.run, header=header)
    if args.only == "openai":
        import bench_openai

        results["openai"] = bench_openai.run(params, args.runs, args.llama_server,
                                             runner=uvloop.run, header=header)
    if args.only == "forced":
        import bench_forced

        results["forced"] = bench_forced.run(params, args.runs, runner=uvloop.run,
                                             header=header, llama_server=args.llama_server)
    if args.only == "tools":
        import bench_tools

        results["tools"] = bench_tools.run(params, args.seeds, args.llama_server,
                                           runner=uvloop.run)
    if concurrency is not None:
        if figures:
            print()
        samples = concurrency.run(params, args.runs, args.llama_server,
                                  args.llama_batched_bench, uvloop.run)
        checks = concurrency.print_table(
            samples, f"Concurrent clients: {header}; llama-server -np = clients, KV "
                     f"{args.llama_server_kv}")
        results["concurrency"] = {
            "samples": samples,
            "stats": {side: concurrency.stats_of(runs) for side, runs in samples.items()},
            "targets": [{"target": label, "measured": value, "met": met}
                        for label, value, met in checks]}
    elapsed = time.perf_counter() - started
    results["elapsed_s"] = elapsed
    Path(args.json).write_text(json.dumps(results, indent=2))
    log(f"bench: {elapsed:.0f} s; results in {args.json}")
    return 0


def run_speculative(params: dict[str, Any], runs: int, llama_server: str | None,
                    header: str) -> dict[str, Any]:
    """scripts/bench_speculative.py against two daemons started here: one takes the
    requests with speculation, the other the same requests without it."""
    import bench_speculative

    async def measure() -> dict[str, list[dict[str, Any]]]:
        # One event loop for the daemons' whole life: a process belongs to the loop that
        # started it. The section itself is synchronous (threads, blocking sockets).
        with_speculation = await Daemon.start(params)
        try:
            without = await Daemon.start(params)
            try:
                return await asyncio.to_thread(
                    bench_speculative.run, params,
                    (with_speculation.socket_path, without.socket_path), runs, llama_server)
            finally:
                await without.stop()
        finally:
            await with_speculation.stop()

    samples = uvloop.run(measure())
    spec_header = f"{header}; llama-server -np {bench_speculative.EDIT_CLIENTS}"
    targets = bench_speculative.print_table(samples, spec_header)
    return {"samples": samples, "medians": bench_speculative.medians(samples),
            "targets": targets}


def run_figures(args: argparse.Namespace, params: dict[str, Any], header: str) -> dict[str, Any]:
    """The single-client figures: every run, the table, the targets; the JSON fields."""
    model = params["model"]
    samples: dict[str, list[dict[str, Any]]] = {
        "ceiling": [], "daemon": [], "peer": [], "llama-bench": []}
    for index in range(args.runs):
        log(f"[run {index + 1}/{args.runs}] ceiling (C API, own process) and daemon (socket) ...")
        ceiling, daemon = uvloop.run(one_run(params, daemon_first=index % 2 == 1))
        samples["ceiling"].append(ceiling)
        samples["daemon"].append(daemon)
        log(f"  ready: ceiling {ceiling['ready_ms']:.0f} ms, daemon {daemon['ready_ms']:.0f} ms; "
            f"1 client {daemon['single_client_tok_s']:.1f} tok/s, 4 clients "
            f"{daemon['concurrent_4_tok_s']:.1f} tok/s")
        if args.llama_bench:
            log(f"[run {index + 1}/{args.runs}] llama-bench ...")
            samples["llama-bench"].append(run_llama_bench(args.llama_bench, params))
            log(f"  tg {samples['llama-bench'][-1]['decode_tok_s']:.1f} tok/s")
        if not args.no_peer:
            log(f"[run {index + 1}/{args.runs}] llama-cpp-python Llama ...")
            peer = run_peer(params)
            samples["peer"].append(peer)
            log(f"  decode {peer['decode_tok_s']:.1f} tok/s")
    keys = [key for key, _, _ in ROWS]
    stats = {side: {key: summary([run[key] for run in runs])
                    for key in keys if runs and key in runs[0]}
             for side, runs in samples.items()}
    kv_mb = samples["ceiling"][0]["kv_mib"] * 1.048576
    bound_mb = os.path.getsize(model) / 1e6 + kv_mb + RSS_HEADROOM_MB
    medians = {side: {key: value["median"] for key, value in figures.items()}
               for side, figures in stats.items()}
    checks = targets(samples, medians, bound_mb)
    print_table(samples, stats, checks, header)
    return {"samples": samples, "stats": stats, "kv_mb": kv_mb, "rss_bound_mb": bound_mb,
            "targets": [{"target": label, "measured": value, "met": met}
                        for label, value, met in checks]}


if __name__ == "__main__":
    sys.exit(main())
