#!/usr/bin/env python3
"""A GGUF with the default model's metadata (all KV pairs, the full tokenizer) and its
tensor names, shapes and quantization types, but random weights: what a GPU machine that
cannot receive the 250 MB model file measures on. Python and numpy only (no gguf-py).

  make_model.py extract REAL.gguf META.json.gz     on the CPU machine: every KV pair and
                                                    the tensor list (name, dims, type)
  make_model.py make  META.json.gz OUT-F16.gguf     F16 matrices N(0, 0.02), F32 norms = 1,
                                                    end-of-generation rows of token_embd = 0
                                                    (tied output: their logit is 0, never the max)
  make_model.py check META.json.gz QUANT.gguf       tensor names, shapes and types, and KV
                                                    pairs, against the real file's; exit 1 on
                                                    a mismatch

llama-quantize turns the F16 file into the real file's types (Q4_K_M; scripts/gpu/run.sh).
"""
import base64
import gzip
import json
import struct
import sys
import time

import numpy as np

GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
              "Q8_1": 9, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
              "Q8_K": 15, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19,
              "IQ4_NL": 20, "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "I8": 24, "I16": 25,
              "I32": 26, "I64": 27, "F64": 28, "IQ1_M": 29, "BF16": 30, "TQ1_0": 34,
              "TQ2_0": 35, "MXFP4": 39}
TYPE_NAMES = {v: k for k, v in GGML_TYPES.items()}
VT = {"u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6, "bool": 7,
      "str": 8, "arr": 9, "u64": 10, "i64": 11, "f64": 12}
VT_NAMES = {v: k for k, v in VT.items()}
FMT = {"u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i",
       "f32": "<f", "bool": "<?", "u64": "<Q", "i64": "<q", "f64": "<d"}
NP = {"u8": "<u1", "i8": "<i1", "u16": "<u2", "i16": "<i2", "u32": "<u4", "i32": "<i4",
      "f32": "<f4", "u64": "<u8", "i64": "<i8", "f64": "<f8", "bool": "<u1"}
# llama-vocab.cpp: token texts that end generation (besides eos/eot ids)
EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["}


def load_meta(path):
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def _s(b):
    return struct.pack("<Q", len(b)) + b


def _value(typ, val):
    if typ == "str":
        return _s(val.encode("utf-8"))
    if typ.startswith("arr:"):
        et = typ[4:]
        if et == "str":
            out = [struct.pack("<IQ", VT["str"], len(val))]
            out += [_s(x.encode("utf-8")) for x in val]
            return b"".join(out)
        raw = base64.b64decode(val["b64"])
        n = len(raw) // np.dtype(NP[et]).itemsize
        return struct.pack("<IQ", VT[et], n) + raw
    return struct.pack(FMT[typ], val)


def _vtype(typ):
    return VT["arr"] if typ.startswith("arr:") else VT[typ]


def make(meta_path, out_path, seed=1234, std=0.02):
    t0 = time.time()
    meta = load_meta(meta_path)
    align = meta.get("alignment", 32)
    kv = []
    for key, typ, val in meta["kv"]:
        # MOSTLY_F16; llama-quantize sets 15 (Q4_K_M)
        kv.append((key, typ, 1 if key == "general.file_type" else val))
    kvd = {k: v for k, _, v in kv}
    tokens = kvd["tokenizer.ggml.tokens"]
    eog = {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
              "tokenizer.ggml.eom_token_id"):
        if k in kvd:
            eog.add(int(kvd[k]))
    tensors = []
    for name, dims, _qtype in meta["tensors"]:
        ttype = "F32" if len(dims) == 1 else "F16"
        n = int(np.prod(dims))
        nbytes = n * (4 if ttype == "F32" else 2)
        tensors.append((name, dims, ttype, n, nbytes))
    header = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, typ, val in kv:
        header += [_s(key.encode()), struct.pack("<I", _vtype(typ)), _value(typ, val)]
    off = 0
    for name, dims, ttype, _n, nbytes in tensors:
        header += [_s(name.encode()), struct.pack("<I", len(dims)),
                   struct.pack(f"<{len(dims)}Q", *dims),
                   struct.pack("<IQ", GGML_TYPES[ttype], off)]
        off += (nbytes + align - 1) // align * align
    head = b"".join(header)
    head += b"\0" * ((-len(head)) % align)
    rng = np.random.default_rng(seed)
    with open(out_path, "wb") as fh:
        fh.write(head)
        for name, dims, ttype, n, nbytes in tensors:
            if ttype == "F32":
                fh.write(np.ones(n, dtype="<f4").tobytes())
            else:
                row = dims[0]
                rows = n // row
                step = max(1, (1 << 24) // row)
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    a = rng.standard_normal((r1 - r0, row), dtype=np.float32)
                    a *= std
                    if name == "token_embd.weight":
                        for t in eog:
                            if r0 <= t < r1:
                                a[t - r0] = 0.0
                    fh.write(a.astype("<f2").tobytes())
            fh.write(b"\0" * ((-nbytes) % align))
    print(f"make_model: {out_path}: {len(kv)} KV, {len(tensors)} tensors, "
          f"{sum(t[4] for t in tensors) / 2**20:.0f} MiB, zeroed EOG rows {sorted(eog)}, "
          f"{time.time() - t0:.1f}s", flush=True)


# ---- a minimal reader (header only) ----
class _R:
    def __init__(self, fh):
        self.fh = fh

    def u(self, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self.fh.read(size))[0]

    def s(self):
        return self.fh.read(self.u("<Q")).decode("utf-8")

    def val(self, vt):
        name = VT_NAMES[vt]
        if name == "str":
            return self.s()
        if name == "arr":
            et = VT_NAMES[self.u("<I")]
            n = self.u("<Q")
            if et == "str":
                return [self.s() for _ in range(n)]
            return np.frombuffer(self.fh.read(n * np.dtype(NP[et]).itemsize), dtype=NP[et])
        return self.u(FMT[name])


def read_header(path):
    with open(path, "rb") as fh:
        r = _R(fh)
        assert fh.read(4) == b"GGUF"
        _version, nt, nkv = r.u("<I"), r.u("<Q"), r.u("<Q")
        kv = {}
        for _ in range(nkv):
            key = r.s()
            kv[key] = r.val(r.u("<I"))
        tensors = _read_tensors(r, nt)
    return kv, tensors


def _read_tensors(r, count):
    """The tensor infos after a GGUF file's KV pairs: [name, dims, type name] each."""
    tensors = []
    for _ in range(count):
        name = r.s()
        dims = [r.u("<Q") for _ in range(r.u("<I"))]
        typ = r.u("<I")
        r.u("<Q")  # the data offset
        tensors.append([name, dims, TYPE_NAMES.get(typ, str(typ))])
    return tensors


def extract(src, dst):
    """The real file's KV pairs (in order, typed as make() writes them) and tensor list."""
    with open(src, "rb") as fh:
        r = _R(fh)
        if fh.read(4) != b"GGUF":
            sys.exit(f"{src}: not a GGUF file")
        _version, nt, nkv = r.u("<I"), r.u("<Q"), r.u("<Q")
        kv = []
        for _ in range(nkv):
            key = r.s()
            vt = VT_NAMES[r.u("<I")]
            if vt == "arr":
                et = VT_NAMES[r.u("<I")]
                n = r.u("<Q")
                if et == "str":
                    kv.append([key, "arr:str", [r.s() for _ in range(n)]])
                elif et == "arr":
                    sys.exit(f"{src}: {key}: nested arrays are not supported")
                else:
                    raw = fh.read(n * np.dtype(NP[et]).itemsize)
                    kv.append([key, "arr:" + et, {"b64": base64.b64encode(raw).decode()}])
            elif vt == "str":
                kv.append([key, "str", r.s()])
            else:
                v = r.u(FMT[vt])
                kv.append([key, vt, bool(v) if vt == "bool" else v])
        tensors = _read_tensors(r, nt)
    align = next((v for k, _, v in kv if k == "general.alignment"), 32)
    meta = {"source": src.split("/")[-1], "alignment": int(align), "kv": kv, "tensors": tensors}
    with gzip.open(dst, "wt", compresslevel=9) as fh:
        json.dump(meta, fh, ensure_ascii=False, separators=(",", ":"))
    print(f"extract: {len(kv)} KV pairs, {len(tensors)} tensors -> {dst}", flush=True)


def check(meta_path, gguf_path):
    meta = load_meta(meta_path)
    kv, tensors = read_header(gguf_path)
    problems = []
    want = {t[0]: t for t in meta["tensors"]}
    have = {t[0]: t for t in tensors}
    for name in want.keys() | have.keys():
        if name not in have:
            problems.append(f"missing tensor {name}")
        elif name not in want:
            problems.append(f"extra tensor {name}")
        elif want[name][1:] != have[name][1:]:
            problems.append(f"{name}: real {want[name][1:]} vs ours {have[name][1:]}")
    for key, typ, val in meta["kv"]:
        if key not in kv:
            problems.append(f"missing KV {key}")
            continue
        got = kv[key]
        if typ.startswith("arr:") and typ != "arr:str":
            same = np.array_equal(
                np.frombuffer(base64.b64decode(val["b64"]), dtype=NP[typ[4:]]), got)
        elif typ == "f32":
            same = abs(got - val) <= 1e-6 * max(1.0, abs(val))
        else:
            same = got == val
        if not same:
            problems.append(f"KV {key}: real {str(val)[:60]} vs ours {str(got)[:60]}")
    extra = set(kv) - {k for k, _, _ in meta["kv"]}
    from collections import Counter
    counts = Counter(t[2] for t in tensors)
    print(f"check {gguf_path}: {len(tensors)} tensors {dict(counts)}; extra KV {sorted(extra)}; "
          f"{len(problems)} mismatches", flush=True)
    for p in problems:
        print("  MISMATCH", p)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("extract", "make", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "extract":
        extract(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
    else:
        sys.exit(check(sys.argv[2], sys.argv[3]))
