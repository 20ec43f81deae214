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
import statistics
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
# A chunk of a step's rows may keep this much of scores (and as much of their softmax);
# docs/performance/longctx.md, "Window layers, chunks of rows", says why at most 4 chunks.
SCORES_BUDGET = 128 << 20
CHUNK_ROWS = 32
MAX_CHUNKS = 4
# Timed runs of each form at each depth, at most; their medians are compared.
ROUNDS = 3
# A gap past which one timed pair decides a depth (`settled`).
CLEAR = 0.15
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
        return f"{self.rows},{self.first},{self.last},{SCORES_BUDGET}"


class Kept(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The file kept beside the step costs: what was measured for, and its range."""

    version: int
    shape: Shape
    cells: Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]
    range: Range | None


_VERSION = 2
_decoder = msgspec.json.Decoder(Kept)


def most_cells(shape: Shape, n_ctx: int) -> int:
    """The deepest step the product may take: the context, or fewer cells where the
    step's scores would not fit SCORES_BUDGET in MAX_CHUNKS chunks."""
    least = -(-shape.rows // MAX_CHUNKS)
    least = -(-least // CHUNK_ROWS) * CHUNK_ROWS
    return min(n_ctx, SCORES_BUDGET // (4 * least * shape.n_head))


def chunk_rows(shape: Shape, cells: int) -> int:
    """The rows of one chunk of a step over `cells` cells, as the patch splits it; 0
    past `most_cells` (flash attention)."""
    chunk = SCORES_BUDGET // (4 * max(cells * shape.n_head, 1)) // CHUNK_ROWS * CHUNK_ROWS
    if chunk >= shape.rows:
        return shape.rows
    return chunk if MAX_CHUNKS * chunk >= shape.rows else 0


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


def settled(flash_ns: list[int], product_ns: list[int]) -> bool:
    """Whether the timed pairs so far decide a depth: every pair puts the product on the
    same side of flash attention, each by more than CLEAR (no moment's noise moves a
    step that much), so the remaining rounds are not needed."""
    ratios = [product / flash for flash, product in zip(flash_ns, product_ns, strict=True)]
    return all(r < 1 - CLEAR for r in ratios) or all(r > 1 + CLEAR for r in ratios)


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
    """(cells, flash ns, product ns) at each of `depths` by rising cells, medians of up
    to ROUNDS runs; none deeper once the product lost clearly at two depths in a row
    (`lost`). Empty where ggml's libraries do not load."""
    ggml = _Ggml.load()
    if ggml is None:
        return []
    timings: list[tuple[int, float, float]] = []
    for cells in depths(shape, n_ctx):
        timings.append((cells, *ggml.time_both(shape, cells, n_threads)))
        if lost(timings):
            break
    return timings


def lost(timings: list[tuple[int, float, float]]) -> bool:
    """Whether the product was slower by more than CLEAR at the last two depths. No
    shape probed so far that lost so at its first depths won deeper, so the deeper
    depths, the longest to time, are not timed."""
    return len(timings) >= 2 and all(product_ns > flash_ns * (1 + CLEAR)
                                     for _, flash_ns, product_ns in timings[-2:])


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


class _Cplan(ctypes.Structure):
    """ggml-cpu.h's struct ggml_cplan."""

    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p),
                ("n_threads", ctypes.c_int), ("threadpool", ctypes.c_void_p),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p),
                ("use_ref", ctypes.c_bool)]


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
            "ggml_view_3d": (p, [p, p, i64, i64, i64, ctypes.c_size_t, ctypes.c_size_t,
                                 ctypes.c_size_t]),
            "ggml_concat": (p, [p, p, p, i32]),
            "ggml_get_first_tensor": (p, [p]),
            "ggml_get_next_tensor": (p, [p, p]),
            "ggml_backend_cpu_buffer_type": (p, []),
            "ggml_gallocr_new": (p, [p]),
            "ggml_gallocr_alloc_graph": (ctypes.c_bool, [p, p]),
            "ggml_gallocr_free": (None, [p]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(base, name)
            function.restype, function.argtypes = restype, argtypes
        self.base = base
        self.plan = cpu.ggml_graph_plan
        self.plan.restype, self.plan.argtypes = _Cplan, [p, i32, p]
        self.compute = cpu.ggml_graph_compute
        self.compute.restype, self.compute.argtypes = i32, [p, p]

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
        """The medians of up to ROUNDS timed runs of each form, taken in turns, so that a
        moment of other work on the machine moves one run of each rather than the whole
        of one form. The memory is laid out by ggml's graph allocator, as llama.cpp's
        compute buffer is (one chunk's scores reused for the next), and touched first."""
        g = self.base
        ctx = g.ggml_init(_InitParams(16 << 20, None, True))
        if not ctx:
            return float("inf"), float("inf")
        allocators: list[Any] = []
        try:
            graphs = self._graphs(ctx, shape, cells)
            for graph in graphs:
                allocators.append(g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type()))
                if not allocators[-1] or not g.ggml_gallocr_alloc_graph(allocators[-1], graph):
                    return float("inf"), float("inf")
            tensor = g.ggml_get_first_tensor(ctx)
            while tensor:
                g.ggml_set_zero(tensor)
                tensor = g.ggml_get_next_tensor(ctx, tensor)
            plans = [self.plan(graph, n_threads, None) for graph in graphs]
            work = ctypes.create_string_buffer(max(plan.work_size for plan in plans) or 1)
            for plan in plans:
                plan.work_data = ctypes.addressof(work)  # no reference cycle through ctypes
            runs: tuple[list[int], list[int]] = ([], [])
            for run in range(ROUNDS):
                for form in (run % 2, 1 - run % 2):
                    started = time.perf_counter_ns()
                    if self.compute(graphs[form], ctypes.byref(plans[form])) != 0:
                        return float("inf"), float("inf")
                    runs[form].append(time.perf_counter_ns() - started)
                if settled(runs[0], runs[1]):
                    break
            return float(statistics.median(runs[0])), float(statistics.median(runs[1]))
        finally:
            for allocator in allocators:
                if allocator:
                    g.ggml_gallocr_free(allocator)
            g.ggml_free(ctx)

    def _graphs(self, ctx: Any, shape: Shape, cells: int) -> tuple[Any, Any]:
        """Flash attention's graph and the product's (by chunks of rows, as the patch
        builds it), over the same K, V and mask."""
        g = self.base
        k = g.ggml_new_tensor_3d(ctx, _F16, shape.head_k, cells, shape.n_head_kv)
        v = g.ggml_new_tensor_3d(ctx, _F16, shape.head_v, cells, shape.n_head_kv)
        mask = g.ggml_new_tensor_3d(ctx, _F16, cells, shape.rows, 1)
        q = g.ggml_new_tensor_3d(ctx, _F32, shape.head_k, shape.rows, shape.n_head)
        scale = 1.0 / shape.head_k ** 0.5
        flash = g.ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0, 0.0)
        g.ggml_prec_set_acc(flash, _PREC_F32)
        v_rows = g.ggml_cont(ctx, g.ggml_transpose(ctx, v))
        chunk = chunk_rows(shape, cells) or shape.rows
        product = None
        for first in range(0, shape.rows, chunk):
            rows = min(chunk, shape.rows - first)
            q_rows = g.ggml_view_3d(ctx, q, shape.head_k, rows, shape.n_head, 4 * shape.head_k,
                                    4 * shape.head_k * shape.rows, 4 * shape.head_k * first)
            mask_rows = g.ggml_view_3d(ctx, mask, cells, rows, 1, 2 * cells,
                                       2 * cells * shape.rows, 2 * cells * first)
            kq = g.ggml_mul_mat(ctx, k, q_rows)
            g.ggml_prec_set_acc(kq, _PREC_F32)
            kq = g.ggml_soft_max_ext(ctx, kq, mask_rows, scale, 0.0)
            part = g.ggml_mul_mat(ctx, v_rows, kq)
            product = part if product is None else g.ggml_concat(ctx, product, part, 1)
        built = []
        for out in (flash, product):
            graph = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(graph, out)
            built.append(graph)
        return built[0], built[1]


def apply(found: Range | None) -> None:
    """Name the range to llama.cpp (read at each graph build), or no range."""
    if found is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = found.env_value()
