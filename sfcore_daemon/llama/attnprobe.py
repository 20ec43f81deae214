"""Which attention a long prompt's full steps take: flash attention, or matrix products.

ggml's CPU flash-attention kernel reads a KV head's cells once for each query head of a
tile of query rows. The matrix-product form (scores = K Q, their softmax, then V times
the scores) reads them once for every row and head together and writes the scores out:
rows x cells x heads floats. For a step of n_ubatch prompt rows deep in a long prompt,
which of the two is faster depends on the model's heads, the depth and the machine
(docs/performance/longctx.md, "Attention as matrix products").

So the daemon measures it, before its context is made: one layer's attention in both
forms with the model's head counts and sizes, n_ubatch query rows, at doubling depths up
to its context, on the threads that read prompts. The range of depths where the product
was faster by MARGIN goes to llama.cpp through ENV, which the project's patch
(scripts/llama-patches/matmul-attention.patch) reads at each graph build: a layer
whose step has n_ubatch rows and attends over that many cells takes the product. Steps of
fewer rows (decode, drafts, prompts beside streams) keep flash attention. The range is
kept beside the step costs, so only a first start measures it, and within a daemon's life
a step's kernels depend on its shape alone.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Annotated, Any, Final

import msgspec

ENV: Final = "SFCORE_MATMUL_ATTN"
# The product must beat flash attention by this share at a depth to be used there: a
# choice kept for every later start should not rest on noise.
MARGIN = 0.03
# The first depth measured; each next one doubles it, up to the context.
FIRST_CELLS = 1024
# The scores of the widest step (rows x cells x heads floats) may take this much of the
# compute buffer; their softmax takes as much again.
SCORES_BUDGET = 128 << 20
_F32, _F16 = 0, 1
_PREC_F32 = 10
MAX_BYTES = 4096


class Shape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One layer's attention as a step of `rows` prompt rows computes it."""

    n_head: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    n_head_kv: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    head_k: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    head_v: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    rows: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class Range(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Steps of at least `rows` rows over `first` to `last` cells take the product."""

    rows: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    first: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    last: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]

    def env_value(self) -> str:
        return f"{self.rows},{self.first},{self.last}"


class Kept(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The file kept beside the step costs: what was measured for, and its range."""

    version: int
    shape: Shape
    cells: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    range: Range | None


_VERSION = 1
_decoder = msgspec.json.Decoder(Kept)


def most_cells(shape: Shape, n_ctx: int) -> int:
    """The deepest step the product may take: the context, or fewer cells where a
    step's scores would outgrow SCORES_BUDGET."""
    return min(n_ctx, SCORES_BUDGET // (4 * shape.rows * shape.n_head))


def depths(shape: Shape, n_ctx: int) -> list[int]:
    """The depths measured: FIRST_CELLS, doubling, and the deepest allowed last."""
    top = most_cells(shape, n_ctx)
    found = []
    cells = FIRST_CELLS
    while cells < top:
        found.append(cells)
        cells *= 2
    if top >= FIRST_CELLS:
        found.append(top)
    return found


def choose(rows: int, timings: list[tuple[int, float, float]]) -> Range | None:
    """The range from (cells, flash ns, product ns) by rising cells: the longest run of
    depths where the product was faster by MARGIN; None where there is none. Past the
    run's last depth the product is not used (its next depth was slower, or none is
    allowed)."""
    best: tuple[int, int] | None = None
    start: int | None = None
    for index, (_, flash_ns, product_ns) in enumerate([*timings, (0, 0.0, 1.0)]):
        faster = product_ns < flash_ns * (1 - MARGIN)
        if faster and start is None:
            start = index
        elif not faster and start is not None:
            if best is None or index - start > best[1] - best[0]:
                best = (start, index)
            start = None
    if best is None:
        return None
    return Range(rows, timings[best[0]][0], timings[best[1] - 1][0])


def parse(data: bytes, shape: Shape, cells: int) -> Kept | None:
    """The kept choice in `data` if it was measured for `shape` and `cells`; None when
    it was not or `data` is not a kept file (measure again)."""
    if len(data) > MAX_BYTES:
        return None
    try:
        kept = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if kept.version != _VERSION or kept.shape != shape or kept.cells != cells:
        return None
    found = kept.range
    if found is not None and not (found.rows == shape.rows and found.first <= found.last
                                  <= most_cells(shape, cells)):
        return None
    return kept


def encode(shape: Shape, cells: int, found: Range | None) -> bytes:
    return msgspec.json.encode(Kept(_VERSION, shape, cells, found))


def measure(shape: Shape, n_ctx: int, n_threads: int) -> list[tuple[int, float, float]]:
    """(cells, flash ns, product ns) at each of `depths`, each a run after a first that
    touches the memory. Empty where ggml's libraries do not load."""
    ggml = _Ggml.load()
    if ggml is None:
        return []
    return [(cells, *ggml.time_both(shape, cells, n_threads)) for cells in depths(shape, n_ctx)]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _Ggml:
    """The few ggml calls the probe makes, from the libraries llama-cpp-python ships."""

    def __init__(self, base: Any, cpu: Any) -> None:
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        signatures: dict[str, tuple[Any, list[Any]]] = {
            "ggml_init": (p, [_InitParams]),
            "ggml_free": (None, [p]),
            "ggml_new_tensor_3d": (p, [p, i32, i64, i64, i64]),
            "ggml_set_zero": (p, [p]),
            "ggml_flash_attn_ext": (p, [p, p, p, p, p, f32, f32, f32]),
            "ggml_prec_set_acc": (ctypes.c_bool, [p, i32]),
            "ggml_mul_mat": (p, [p, p, p]),
            "ggml_soft_max_ext": (p, [p, p, p, f32, f32]),
            "ggml_transpose": (p, [p, p]),
            "ggml_cont": (p, [p, p]),
            "ggml_new_graph": (p, [p]),
            "ggml_build_forward_expand": (None, [p, p]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(base, name)
            function.restype, function.argtypes = restype, argtypes
        self.base = base
        self.compute = cpu.ggml_graph_compute_with_ctx
        self.compute.restype, self.compute.argtypes = i32, [p, p, i32]

    @classmethod
    def load(cls) -> _Ggml | None:
        from sfcore_daemon.llama.capi import C

        folder = Path(C.__file__).parent / "lib"
        try:
            base = ctypes.CDLL(str(next(folder.glob("libggml-base.*"))))
            cpu = ctypes.CDLL(str(next(folder.glob("libggml-cpu.*"))))
            return cls(base, cpu)
        except (OSError, StopIteration, AttributeError):
            return None

    def time_both(self, shape: Shape, cells: int, n_threads: int) -> tuple[float, float]:
        return (self._time(shape, cells, n_threads, product=False),
                self._time(shape, cells, n_threads, product=True))

    def _time(self, shape: Shape, cells: int, n_threads: int, *, product: bool) -> float:
        g = self.base
        rows, scores = shape.rows, 4 * shape.rows * cells * shape.n_head
        size = (4 * rows * shape.n_head * (shape.head_k + 2 * shape.head_v)
                + 4 * cells * shape.n_head_kv * (shape.head_k + shape.head_v)
                + 2 * cells * rows + (3 * scores if product else 0) + (64 << 20))
        ctx = g.ggml_init(_InitParams(size, None, False))
        if not ctx:
            return float("inf")
        try:
            q = g.ggml_new_tensor_3d(ctx, _F32, shape.head_k, rows, shape.n_head)
            k = g.ggml_new_tensor_3d(ctx, _F16, shape.head_k, cells, shape.n_head_kv)
            v = g.ggml_new_tensor_3d(ctx, _F16, shape.head_v, cells, shape.n_head_kv)
            mask = g.ggml_new_tensor_3d(ctx, _F16, cells, rows, 1)
            for tensor in (q, k, v, mask):
                g.ggml_set_zero(tensor)
            scale = 1.0 / shape.head_k ** 0.5
            if product:
                kq = g.ggml_mul_mat(ctx, k, q)
                g.ggml_prec_set_acc(kq, _PREC_F32)
                kq = g.ggml_soft_max_ext(ctx, kq, mask, scale, 0.0)
                out = g.ggml_mul_mat(ctx, g.ggml_cont(ctx, g.ggml_transpose(ctx, v)), kq)
            else:
                out = g.ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0, 0.0)
                g.ggml_prec_set_acc(out, _PREC_F32)
            graph = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(graph, out)
            best = float("inf")
            for run in range(2):  # the first touches the memory
                started = time.perf_counter_ns()
                if self.compute(ctx, graph, n_threads) != 0:
                    return float("inf")
                if run:
                    best = time.perf_counter_ns() - started
            return best
        finally:
            g.ggml_free(ctx)


def apply(found: Range | None) -> None:
    """Name the range to llama.cpp (read at each graph build), or no range."""
    if found is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = found.env_value()
