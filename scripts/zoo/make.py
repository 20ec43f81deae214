#!/usr/bin/env python3
"""Random-weight GGUF models of varied shapes for the benches (docs/performance/zoo.md).

  make.py [--out DIR] [--only NAME,...] [--llama-quantize PATH]   write the missing ones
  make.py --list                                                  the shapes
  make.py --check [--daemon]                                      load each, generate

Each shape (scripts/zoo/shapes.py) is written once as F16 (random weights, norms one, the
end-of-generation tokens' output rows zero) with a real tokenizer (SmolLM2's for llama,
qwen2 and qwen3, padded or cut to the shape's vocabulary; the default model's for gemma2
and gemma3), then llama-quantize makes it the shape's type. A file whose zoo.shape_hash
matches is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "scripts" / "gpu"), str(REPO)]

import ggufio as gguf  # noqa: E402
from make_model import EOG_TEXTS  # noqa: E402
from shapes import BY_NAME, SHAPES, params, shape_hash, swa_pattern, tensor_dims  # noqa: E402

DEFAULT_OUT = Path.home() / ".cache" / "sfcore-ai" / "zoo"
PAD = "\u0120zoo_pad{}"  # a byte-level BPE word: decodes to " zoo_padN"


def source_paths(args: argparse.Namespace) -> dict[str, Path]:
    smol = args.smollm2
    if smol is None:
        from tests.kit.models import smollm2_path
        smol = smollm2_path()
    gemma = args.gemma
    if gemma is None:
        from sfcore_daemon.llama.modelfile import default_model_path
        gemma = default_model_path()
    return {"smollm2": Path(smol), "gemma": Path(gemma)}


def tokenizer_kv(shape: dict[str, Any], sources: dict[str, Path],
                 cache: dict[str, list]) -> tuple[list[tuple[str, str, Any]], set[int]]:
    """The shape's tokenizer.* pairs and its end-of-generation token ids."""
    src = "gemma" if shape["arch"] in ("gemma2", "gemma3") else "smollm2"
    if src not in cache:
        cache[src] = [x for x in gguf.read_kv(sources[src]) if x[0].startswith("tokenizer.")]
    kv = {k: (t, v) for k, t, v in cache[src]}
    n = shape["n_vocab"]
    tokens = kv["tokenizer.ggml.tokens"][1]
    if src == "gemma":
        if n != len(tokens):
            raise SystemExit(f"{shape['name']}: gemma shapes keep the real vocabulary "
                             f"({len(tokens)} tokens), not {n}")
        out = list(cache[src])
    else:
        index = {t: i for i, t in enumerate(tokens)}
        pads = [PAD.format(i) for i in range(n - len(tokens))]
        if any(p in index for p in pads):
            raise SystemExit("a padding token's text is already in the vocabulary")
        new_tokens = tokens[:n] + pads
        # A cut vocabulary keeps the merges that build its tokens (they come in id order).
        merges = [m for m in kv["tokenizer.ggml.merges"][1]
                  if index.get(m.replace(" ", "", 1), n) < n]
        types = kv["tokenizer.ggml.token_type"][1][:n].tolist() + [1] * len(pads)
        out = []
        replaced = {"tokenizer.ggml.tokens": new_tokens, "tokenizer.ggml.merges": merges,
                    "tokenizer.ggml.token_type": types}
        for key, typ, val in cache[src]:
            if key.endswith("_token_id") and val >= n:
                raise SystemExit(f"{shape['name']}: {key} {val} is past the vocabulary")
            out.append((key, typ, replaced.get(key, val)))
        tokens = new_tokens
    eog = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    for key in ("eos", "eot", "eom"):
        if f"tokenizer.ggml.{key}_token_id" in kv:
            eog.add(int(kv[f"tokenizer.ggml.{key}_token_id"][1]))
    return out, eog


def model_kv(shape: dict[str, Any]) -> list[tuple[str, str, Any]]:
    a = shape["arch"]
    kv = [("general.architecture", "str", a),
          ("zoo.shape_hash", "str", shape_hash(shape)),
          ("zoo.shape", "str", json.dumps(shape, sort_keys=True)),
          ("general.type", "str", "model"),
          ("general.name", "str", f"zoo {shape['name']}"),
          ("general.file_type", "u32", 1),
          (f"{a}.context_length", "u32", shape["n_ctx_train"]),
          (f"{a}.embedding_length", "u32", shape["n_embd"]),
          (f"{a}.block_count", "u32", shape["n_layer"]),
          (f"{a}.feed_forward_length", "u32", shape["n_ff"]),
          (f"{a}.attention.head_count", "u32", shape["n_head"]),
          (f"{a}.attention.head_count_kv", "u32", shape["n_head_kv"]),
          (f"{a}.attention.key_length", "u32", shape["head_dim"]),
          (f"{a}.attention.value_length", "u32", shape["head_dim"]),
          (f"{a}.rope.freq_base", "f32", shape["rope_base"]),
          (f"{a}.attention.layer_norm_rms_epsilon", "f32", shape["rms_eps"])]
    if a in ("llama", "qwen2", "qwen3"):
        kv.append((f"{a}.rope.dimension_count", "u32", shape["head_dim"]))
    if a == "llama":
        kv.append(("llama.vocab_size", "u32", shape["n_vocab"]))
    if shape["swa"]:
        kv += [(f"{a}.attention.sliding_window", "u32", shape["swa"]),
               (f"{a}.attention.sliding_window_pattern", "u32", swa_pattern(shape))]
    if "softcap" in shape:
        kv += [(f"{a}.attn_logit_softcapping", "f32", shape["softcap"][0]),
               (f"{a}.final_logit_softcapping", "f32", shape["softcap"][1])]
    return kv


def present(path: Path, shape: dict[str, Any]) -> bool:
    if not path.is_file():
        return False
    try:
        kv = gguf.read_kv(path, stop_at="zoo.shape_hash")
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return False
    return any(k == "zoo.shape_hash" and v == shape_hash(shape) for k, _, v in kv)


def find_quantize(given: str | None) -> str:
    path = given or os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")
    if not path or not Path(path).is_file():
        raise SystemExit("llama-quantize not found: give --llama-quantize PATH or "
                         "LLAMA_QUANTIZE (docs/performance/zoo.md builds it)")
    return path


def make_one(shape: dict[str, Any], out: Path, sources: dict[str, Path], cache: dict, *,
             quantize: str, threads: int) -> None:
    name = shape["name"]
    final = out / f"{name}.gguf"
    f16 = out / f"{name}.f16.tmp"
    partial = out / f"{name}.gguf.tmp"
    tok_kv, eog = tokenizer_kv(shape, sources, cache)
    tensors = []
    for tname, dims, fill in tensor_dims(shape):
        t = gguf.Tensor(tname, dims, fill)
        if tname == ("token_embd.weight" if shape["tied"] else "output.weight"):
            t.zero_rows = set(eog)
        tensors.append(t)
    t0 = time.time()
    print(f"zoo: {name}: writing F16 ({params(shape) / 1e9:.2f}B params)", file=sys.stderr,
          flush=True)
    gguf.write(f16, model_kv(shape) + tok_kv, tensors)
    t1 = time.time()
    print(f"zoo: {name}: F16 in {t1 - t0:.0f}s; llama-quantize {shape['quant']}",
          file=sys.stderr, flush=True)
    try:
        run = subprocess.run(["nice", "-n", "10", quantize, str(f16), str(partial),
                              shape["quant"], str(threads)],
                             check=False, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"llama-quantize failed for {name}:\n{run.stdout[-2000:]}"
                             f"{run.stderr[-2000:]}")
        partial.replace(final)
        # The daemon's record of the old file's sha256 (it checks size and mtime too).
        final.with_name(final.name + ".sha256").unlink(missing_ok=True)
    finally:
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    print(f"zoo: {name}: quantized in {time.time() - t1:.0f}s -> {final}", file=sys.stderr,
          flush=True)


def table(shapes: list[dict[str, Any]], out: Path) -> str:
    head = ["name", "arch", "params", "vocab", "n_embd", "layers", "ff", "heads/kv",
            "head_dim", "swa", "quant", "file"]
    rows = []
    for s in shapes:
        path = out / f"{s['name']}.gguf"
        size = f"{path.stat().st_size / 2**20:.0f} MiB" if present(path, s) else "-"
        rows.append([s["name"], s["arch"], f"{params(s) / 1e9:.2f}B", f"{s['n_vocab']:,}",
                     str(s["n_embd"]), str(s["n_layer"]), str(s["n_ff"]),
                     f"{s['n_head']}/{s['n_head_kv']}", str(s["head_dim"]),
                     f"{s['swa']} on {swa_pattern(s) - 1}/{swa_pattern(s)}" if s["swa"] else "-",
                     s["quant"] + ("" if s["tied"] else " untied"), size])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def check_llama(shape: dict[str, Any], path: Path, threads: int) -> bool:
    """Load through llama-cpp-python's Llama and decode greedily a few tokens."""
    from llama_cpp import Llama

    t0 = time.time()
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
    load = time.time() - t0
    ok = llm.n_vocab() == shape["n_vocab"] and llm.n_embd() == shape["n_embd"]
    template = "tokenizer.chat_template" in llm.metadata
    prompt = "The quick brown fox jumps over the lazy dog. Then"
    t1 = time.time()
    res = llm.create_completion(prompt, max_tokens=24, temperature=0.0)
    dt = time.time() - t1
    n = res["usage"]["completion_tokens"]
    reason = res["choices"][0]["finish_reason"]
    ok = ok and n == 24 and reason == "length"
    types = ", ".join(f"{k} {v}" for k, v in gguf.read_tensor_types(path).items() if k != "F32")
    print(f"check {shape['name']}: {'ok' if ok else 'FAILED'}; {types}; load {load:.1f}s, "
          f"n_vocab {llm.n_vocab()}, chat template in file {template}, "
          f"prompt {res['usage']['prompt_tokens']} tokens, {n} generated "
          f"({reason}) in {dt:.2f}s: {res['choices'][0]['text'][:60]!r}", flush=True)
    del llm
    return ok


def check_daemon(shape: dict[str, Any], path: Path) -> bool:
    """One chat request through the daemon, which renders the template and streams."""
    import asyncio

    from tests.kit.daemon import start_daemon

    async def run() -> dict[str, Any]:
        daemon = await start_daemon({"model": {"path": str(path)},
                                     "generation": {"max_tokens": 24}})
        try:
            async with daemon.client() as client:
                return await client.final({"op": "chat", "stream": False, "max_tokens": 24,
                                           "messages": [{"role": "user", "content": "Hi!"}]},
                                          timeout=300)
        finally:
            await daemon.stop()
            await daemon.close()

    done = asyncio.run(run())
    usage = done.get("usage", {})
    ok = done.get("type") == "done" and usage.get("completion_tokens") == 24
    print(f"daemon {shape['name']}: {'ok' if ok else 'FAILED'}; "
          f"finish {done.get('finish_reason')}, usage {usage}, "
          f"text {str(done.get('text', done))[:60]!r}", flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", help="shape names, comma separated")
    p.add_argument("--llama-quantize", help="its path (else LLAMA_QUANTIZE, else PATH)")
    p.add_argument("--threads", type=int, default=2, help="for llama-quantize and --check")
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    p.add_argument("--check", action="store_true",
                   help="load each present model and generate (no writing)")
    p.add_argument("--daemon", action="store_true", help="with --check: also a chat "
                   "request through the daemon")
    p.add_argument("--smollm2", type=Path, help="the llama/qwen2 tokenizer's GGUF")
    p.add_argument("--gemma", type=Path, help="the gemma3 tokenizer's GGUF")
    args = p.parse_args()
    shapes = SHAPES
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in BY_NAME]
        if unknown:
            p.error(f"unknown shapes {unknown}; --list names them")
        shapes = [BY_NAME[n] for n in args.only.split(",")]
    if args.list:
        print(table(shapes, args.out))
        return 0
    if args.check:
        failed = 0
        for s in shapes:
            path = args.out / f"{s['name']}.gguf"
            if not present(path, s):
                print(f"check {s['name']}: not built", flush=True)
                continue
            failed += not check_llama(s, path, args.threads)
            if args.daemon:
                failed += not check_daemon(s, path)
        return 1 if failed else 0
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [s for s in shapes if not present(args.out / f"{s['name']}.gguf", s)]
    if todo:
        quantize = find_quantize(args.llama_quantize)
        sources = source_paths(args)
        cache: dict[str, list] = {}
        for s in todo:
            make_one(s, args.out, sources, cache, quantize=quantize, threads=args.threads)
    print(table(shapes, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
