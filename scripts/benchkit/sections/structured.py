"""Structured output: constrained decode (json_schema) against unconstrained decode of the
same prompt with the same sampling, on one daemon; llama-cpp-python's `Llama` with the same
grammar beside it (unless --no-peer)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from benchkit.common import SAMPLED, TIMEOUT_S, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.table import cell, paired_ratio, print_targets, summary, targets_json

HELP = "constrained decode (json_schema) against unconstrained, the same prompt"


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
        await stream.figures({**constrained, "max_tokens": 8})  # warm-up (and the cache)
        before = (await _stats(stream))["grammar"]
        tokens = STRUCTURED_MAX_TOKENS
        for kind in ("constrained", "unconstrained", "unconstrained", "constrained") * 3:
            if kind == "constrained":
                run = await stream.figures(constrained)
                if run["done"]["finish_reason"] != "stop":
                    raise RuntimeError(f"the constrained document did not end: {run['done']}")
                tokens = run["tokens"]
            else:
                # The same prompt and sampling, as many tokens as the document took.
                run = await stream.figures({**constrained, "json_schema": None,
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


def run_structured(params: dict[str, Any], runs: int, peer: bool,
                   runner: Callable[[Any], Any]) -> dict[str, Any]:
    """The structured-output section: every run measures the daemon both ways, then (with
    the peer) llama-cpp-python's Llama with the same grammar, right after."""
    samples: list[dict[str, Any]] = []
    for index in range(runs):
        log(f"[structured {index + 1}/{runs}] daemon, constrained and unconstrained ...")
        sample = runner(structured_run(params))
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


def run(bench: Bench) -> dict[str, Any]:
    section = run_structured(bench.params, bench.runs, not bench.args.no_peer, bench.runner)
    print(bench.header)
    checks = print_structured(section)
    print_targets(checks)
    return {"section": section, "targets": targets_json(checks)}
