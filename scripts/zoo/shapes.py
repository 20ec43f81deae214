"""The zoo's shapes: what llama.cpp's speed depends on (vocabulary, width, depth, heads
per KV head, sliding-window layers, quantization), each named after the model it mimics.

A shape is a dict: arch (llama, qwen2, qwen3, gemma2, gemma3), n_vocab, n_embd, n_layer,
n_ff, n_head, n_head_kv, head_dim, swa (the sliding window, or 0 for none), swa_pattern
(one layer in that many attends to the whole context; 6 where not given), softcap (gemma2:
the caps on attention and output logits), tied (the output matrix is the token
embedding), quant (a llama-quantize type) and the architecture's rope_base, rms_eps and
n_ctx_train. docs/performance/zoo.md has the table.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

# Bump when the file written for an unchanged shape changes (tokenizer, weights, keys).
GENERATOR_VERSION = 1

ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rope_base": 500000.0, "rms_eps": 1e-5, "n_ctx_train": 131072, "swa": 0},
    "qwen2": {"rope_base": 1000000.0, "rms_eps": 1e-6, "n_ctx_train": 32768, "swa": 0},
    "qwen3": {"rope_base": 1000000.0, "rms_eps": 1e-6, "n_ctx_train": 40960, "swa": 0},
    "gemma2": {"rope_base": 10000.0, "rms_eps": 1e-6, "n_ctx_train": 8192, "swa": 4096,
               "swa_pattern": 2, "softcap": [50.0, 30.0]},
    "gemma3": {"rope_base": 1000000.0, "rms_eps": 1e-6, "n_ctx_train": 32768, "swa": 512},
}


def _shape(name: str, arch: str, **fields: Any) -> dict[str, Any]:
    shape = {"name": name, "arch": arch, "tied": True, **ARCH_DEFAULTS[arch], **fields}
    shape.setdefault("head_dim", shape["n_embd"] // shape["n_head"])
    return shape


def swa_pattern(shape: dict[str, Any]) -> int:
    return int(shape.get("swa_pattern", 6))


SHAPES: list[dict[str, Any]] = [
    # SmolLM-135M-like but multi-head (a KV head per query head) and half as deep.
    _shape("llama-0.1b-mha", "llama", n_vocab=49152, n_embd=576, n_layer=12, n_ff=1536,
           n_head=9, n_head_kv=9, quant="Q8_0", rope_base=100000.0, n_ctx_train=8192),
    _shape("llama-0.3b-gqa8", "llama", n_vocab=49152, n_embd=1024, n_layer=24, n_ff=2816,
           n_head=16, n_head_kv=2, quant="Q5_0", rope_base=100000.0, n_ctx_train=8192),
    _shape("qwen2-0.5b", "qwen2", n_vocab=151936, n_embd=896, n_layer=24, n_ff=4864,
           n_head=14, n_head_kv=2, quant="Q4_K_M"),
    _shape("llama-0.7b-gqa2-32k", "llama", n_vocab=32000, n_embd=1536, n_layer=24, n_ff=4096,
           n_head=12, n_head_kv=6, quant="Q8_0", rope_base=10000.0, n_ctx_train=4096),
    # TinyLlama/Llama-2 style: 32k vocabulary and an output matrix of its own.
    _shape("llama-1b-32k", "llama", n_vocab=32000, n_embd=2048, n_layer=16, n_ff=8192,
           n_head=32, n_head_kv=8, quant="Q4_0", tied=False, rope_base=10000.0,
           n_ctx_train=4096),
    _shape("qwen2-1.5b", "qwen2", n_vocab=151936, n_embd=1536, n_layer=28, n_ff=8960,
           n_head=12, n_head_kv=2, quant="Q4_K_M"),
    # Qwen3-0.6B-like: per-head norms on Q and K, 128-wide heads wider than n_embd / n_head.
    _shape("qwen3-0.6b", "qwen3", n_vocab=151936, n_embd=1024, n_layer=28, n_ff=3072,
           n_head=16, n_head_kv=8, head_dim=128, quant="Q8_0"),
    # The default model's shape with global attention on every layer, in Q4_0.
    _shape("gemma3-270m-noswa", "gemma3", n_vocab=262144, n_embd=640, n_layer=18, n_ff=2048,
           n_head=4, n_head_kv=1, head_dim=256, swa=0, quant="Q4_0"),
    # Gemma 2 style: logits capped by tanh in attention and at the output, a window on
    # every other layer (a short one here, so that a bench's prompts reach past it).
    _shape("gemma2-0.4b", "gemma2", n_vocab=262144, n_embd=1024, n_layer=12, n_ff=4096,
           n_head=8, n_head_kv=4, head_dim=128, swa=512, quant="Q5_0"),
    _shape("gemma3-1b", "gemma3", n_vocab=262144, n_embd=1152, n_layer=26, n_ff=6912,
           n_head=4, n_head_kv=1, head_dim=256, quant="Q4_K_M"),
]

BY_NAME = {s["name"]: s for s in SHAPES}


def shape_hash(shape: dict[str, Any]) -> str:
    text = json.dumps({"v": GENERATOR_VERSION, **shape}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tensor_dims(shape: dict[str, Any]) -> list[tuple[str, list[int], str]]:
    """(name, dims, fill) of every tensor, dims row length first as GGUF stores them."""
    e, v, f, hd = shape["n_embd"], shape["n_vocab"], shape["n_ff"], shape["head_dim"]
    q, kv = shape["n_head"] * hd, shape["n_head_kv"] * hd
    out = [("token_embd.weight", [e, v], "random"), ("output_norm.weight", [e], "ones")]
    if not shape["tied"]:
        out.append(("output.weight", [e, v], "random"))
    for i in range(shape["n_layer"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", [e], "ones"),
                (b + "attn_q.weight", [e, q], "random"),
                (b + "attn_k.weight", [e, kv], "random"),
                (b + "attn_v.weight", [e, kv], "random"),
                (b + "attn_output.weight", [q, e], "random"),
                (b + "ffn_norm.weight", [e], "ones"),
                (b + "ffn_gate.weight", [e, f], "random"),
                (b + "ffn_up.weight", [e, f], "random"),
                (b + "ffn_down.weight", [f, e], "random")]
        if shape["arch"] == "qwen2":
            out += [(b + "attn_q.bias", [q], "zeros"), (b + "attn_k.bias", [kv], "zeros"),
                    (b + "attn_v.bias", [kv], "zeros")]
        if shape["arch"] == "qwen3":
            out += [(b + "attn_q_norm.weight", [hd], "ones"),
                    (b + "attn_k_norm.weight", [hd], "ones")]
        if shape["arch"] == "gemma3":
            out += [(b + "attn_q_norm.weight", [hd], "ones"),
                    (b + "attn_k_norm.weight", [hd], "ones")]
        if shape["arch"] in ("gemma2", "gemma3"):
            out += [(b + "post_attention_norm.weight", [e], "ones"),
                    (b + "post_ffw_norm.weight", [e], "ones")]
    return out


def params(shape: dict[str, Any]) -> int:
    total = 0
    for _name, dims, _fill in tensor_dims(shape):
        n = 1
        for d in dims:
            n *= d
        total += n
    return total
