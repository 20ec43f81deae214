"""The ceiling: llama.cpp driven through llama-cpp-python's low-level C API and llama.cpp's
C sampler chain, with the daemon's context settings, in a process of its own
(`scripts/bench.py --ceiling-worker PARAMS`), answering one JSON command per line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchkit.common import (
    REPO,
    SAMPLED,
    TIMEOUT_S,
    filler_text,
    generation_figures,
    peak_rss_mb,
)

PREFILL_TOKENS = 512
PREFIX_TOKENS = 1000


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
            sys.executable, str(REPO / "scripts" / "bench.py"), "--ceiling-worker",
            json.dumps(params), cwd=REPO,
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
