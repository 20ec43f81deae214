"""A typed GGUF header reader and an F16 random-weight writer, numpy only (no gguf-py).

The writer follows scripts/gpu/make_model.py: matrices N(0, std) in F16, 1-D tensors F32
(norms ones, biases zeros), chosen rows of a matrix zero. KV pairs are (key, type, value)
triples; a type is a scalar name ("u32", "f32", "str", ...) or "arr:" and an element type,
numeric arrays as numpy arrays, string arrays as lists.
"""
from __future__ import annotations

import importlib.util
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The GGUF format's tables, from the GPU kit's writer (a script of its own, loaded by path).
_spec = importlib.util.spec_from_file_location(
    "make_model", Path(__file__).resolve().parent.parent / "gpu" / "make_model.py")
assert _spec is not None and _spec.loader is not None
_make_model: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_make_model)
TYPE_NAMES: dict[int, str] = _make_model.TYPE_NAMES
VT: dict[str, int] = _make_model.VT
VT_NAMES: dict[int, str] = _make_model.VT_NAMES
FMT: dict[str, str] = _make_model.FMT
NP: dict[str, str] = _make_model.NP
GGML_F32, GGML_F16 = _make_model.GGML_TYPES["F32"], _make_model.GGML_TYPES["F16"]
ALIGN = 32


@dataclass
class Tensor:
    """One tensor to write: dims as GGUF stores them (row length first)."""

    name: str
    dims: list[int]
    fill: str = "random"  # random (F16), ones or zeros (F32)
    zero_rows: set[int] = field(default_factory=set)

    @property
    def count(self) -> int:
        return int(np.prod(self.dims))

    @property
    def nbytes(self) -> int:
        return self.count * (2 if self.fill == "random" else 4)


class _Reader:
    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def u(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.fh.read(struct.calcsize(fmt)))[0]

    def s(self) -> str:
        return self.fh.read(self.u("<Q")).decode("utf-8")

    def value(self, vt: str) -> tuple[str, Any]:
        if vt == "str":
            return "str", self.s()
        if vt != "arr":
            return vt, self.u(FMT[vt])
        et = VT_NAMES[self.u("<I")]
        n = self.u("<Q")
        if et == "str":
            return "arr:str", [self.s() for _ in range(n)]
        raw = self.fh.read(n * np.dtype(NP[et]).itemsize)
        return "arr:" + et, np.frombuffer(raw, dtype=NP[et]).copy()

    def skim(self, vt: str) -> Any:
        """A value as `value` reads it, but an array as its length, its items skipped."""
        if vt != "arr":
            return self.value(vt)[1]
        et = VT_NAMES[self.u("<I")]
        n = self.u("<Q")
        if et == "str":
            for _ in range(n):
                self.fh.seek(self.u("<Q"), 1)
        else:
            self.fh.seek(n * np.dtype(NP[et]).itemsize, 1)
        return n

    def skim_header(self) -> tuple[int, dict[str, Any]]:
        """The tensor count and the KV pairs (arrays as their lengths), the file left at
        the first tensor's info."""
        if self.fh.read(4) != b"GGUF":
            raise ValueError(f"{getattr(self.fh, 'name', 'file')}: not a GGUF file")
        _version, nt, nkv = self.u("<I"), self.u("<Q"), self.u("<Q")
        kv = {}
        for _ in range(nkv):
            key = self.s()
            kv[key] = self.skim(VT_NAMES[self.u("<I")])
        return nt, kv

    def tensor_info(self) -> tuple[list[int], int]:
        """The next tensor's dims and ggml type (its name and data offset skipped)."""
        self.fh.seek(self.u("<Q"), 1)
        dims = [self.u("<Q") for _ in range(self.u("<I"))]
        typ = self.u("<I")
        self.u("<Q")
        return dims, typ


def read_kv(path: str | Path, stop_at: str | None = None) -> list[tuple[str, str, Any]]:
    """The KV pairs of a GGUF file in order; with `stop_at`, up to and including that key."""
    out = []
    with open(path, "rb") as fh:
        r = _Reader(fh)
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        _version, _nt, nkv = r.u("<I"), r.u("<Q"), r.u("<Q")
        for _ in range(nkv):
            key = r.s()
            typ, val = r.value(VT_NAMES[r.u("<I")])
            out.append((key, typ, val))
            if key == stop_at:
                break
    return out


def read_tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each ggml type the file holds."""
    counts: dict[str, int] = {}
    with open(path, "rb") as fh:
        r = _Reader(fh)
        nt, _ = r.skim_header()
        for _ in range(nt):
            typ = r.tensor_info()[1]
            name = TYPE_NAMES.get(typ, str(typ))
            counts[name] = counts.get(name, 0) + 1
    return counts


def read_summary(path: str | Path) -> tuple[dict[str, Any], int]:
    """The KV pairs (an array as its length) and how many elements the tensors hold."""
    with open(path, "rb") as fh:
        r = _Reader(fh)
        nt, kv = r.skim_header()
        elements = sum(int(np.prod(r.tensor_info()[0])) for _ in range(nt))
    return kv, elements


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _value(typ: str, val: Any) -> bytes:
    if typ == "str":
        return _s(val.encode("utf-8"))
    if typ == "arr:str":
        return struct.pack("<IQ", VT["str"], len(val)) + b"".join(
            _s(x.encode("utf-8")) for x in val)
    if typ.startswith("arr:"):
        arr = np.asarray(val, dtype=NP[typ[4:]])
        return struct.pack("<IQ", VT[typ[4:]], arr.size) + arr.tobytes()
    return struct.pack(FMT[typ], val)


class _Pool:
    """Random F16 values cut from one pool at random offsets: generating every weight
    afresh costs far more CPU, and a speed benchmark cannot tell the difference."""

    def __init__(self, seed: int, std: float, size: int = 1 << 23) -> None:
        self.rng = np.random.default_rng(seed)
        self.half = size // 2
        self.values = (self.rng.standard_normal(size, dtype=np.float32) * std).astype("<f2")

    def take(self, n: int) -> np.ndarray:
        off = int(self.rng.integers(0, self.half))
        return self.values[off:off + n]


def write(path: str | Path, kv: Iterable[tuple[str, str, Any]], tensors: list[Tensor],
          seed: int = 1234, std: float = 0.02) -> None:
    kv = list(kv)
    header = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(kv))]
    for key, typ, val in kv:
        vt = VT["arr"] if typ.startswith("arr:") else VT[typ]
        header += [_s(key.encode()), struct.pack("<I", vt), _value(typ, val)]
    off = 0
    for t in tensors:
        ggml_type = GGML_F16 if t.fill == "random" else GGML_F32
        header += [_s(t.name.encode()), struct.pack("<I", len(t.dims)),
                   struct.pack(f"<{len(t.dims)}Q", *t.dims), struct.pack("<IQ", ggml_type, off)]
        off += (t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    head = b"".join(header)
    head += b"\0" * ((-len(head)) % ALIGN)
    pool = _Pool(seed, std)
    with open(path, "wb") as fh:
        fh.write(head)
        for t in tensors:
            if t.fill != "random":
                value = 1.0 if t.fill == "ones" else 0.0
                fh.write(np.full(t.count, value, dtype="<f4").tobytes())
            else:
                row = t.dims[0]
                rows = t.count // row
                step = max(1, pool.half // row)
                for r0 in range(0, rows, step):
                    r1 = min(rows, r0 + step)
                    chunk = pool.take((r1 - r0) * row)
                    hit = [r - r0 for r in t.zero_rows if r0 <= r < r1]
                    if hit:
                        chunk = chunk.reshape(r1 - r0, row).copy()
                        chunk[hit] = 0
                    fh.write(chunk.tobytes())
            fh.write(b"\0" * ((-t.nbytes) % ALIGN))
