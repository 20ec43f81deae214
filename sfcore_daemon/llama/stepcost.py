"""What a decode step of r logit rows costs on this model, machine and build: measured
once, before the daemon serves, for the draft gate (engine/draftgate.py), and kept in
the cache folder so that later starts read it instead.

One sequence after a short prompt, every row asking for logits (the shape of a step
that verifies a draft), on the daemon's own threads; each size the fastest of a few
rounds, in a shuffled order each round. Then the same after DEPTH cells of context: each
verification row attends over the whole context, so a draft costs more at depth than its
rows' share of the weights, and what one row adds per cell is kept under DEPTH_KEY (and
past DEPTH under FAR_DEPTH_KEY, measured at twice DEPTH where some layers attend to a
window only). With each, what a prompt row (no logits) adds to a one-row step: steps
beside streams take prompt rows by it (engine/prefillshare.py).
The threads and the machine's load both change the figures
(docs/performance/speculative.md), so costs measured while other processes kept the
CPUs busy serve this run only, and the next start measures again (`busy_share`).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

from sfcore_daemon.config import CacheConfig
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import Model
from sfcore_daemon.llama.modelfile import cache_dir

# Both sides of the multiples of 4 the output kernel groups rows by, and wide steps measured
# too: drawn on from 17 they came out too dear (docs/performance/speculative.md).
SIZES = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
ROUNDS = 2
# The context the depth cost is measured at, and the row count compared with one row.
DEPTH = 1024
_DEPTH_ROWS = 8
# The costs' keys for the ns one logit row adds per cell of context up to DEPTH, and past it
# (draftgate.StepCosts): a sliding-window layer's row attends to its window only.
DEPTH_KEY = 0
FAR_DEPTH_KEY = -3
# The costs' keys for the ns a prompt row adds to a step, and what it adds per cell of
# context up to DEPTH and past it (engine/prefillshare.py).
PROMPT_ROW_KEY = -1
PROMPT_CELL_KEY = -2
FAR_PROMPT_CELL_KEY = -4
# Prompt rows of the step that measures them: about as many as a step beside streams takes.
_PROMPT_ROWS = 16
# Other processes' share of the CPUs during the measurement above which it is not kept.
BUSY_SHARE = 0.1
_PROMPT_TOKENS = 8


def measure_step_costs(model: Model, sizes: tuple[int, ...] = SIZES,
                       rounds: int = ROUNDS, *, most_rows: int) -> dict[int, float]:
    """rows -> ns of one llama_decode of that many rows (the fastest of `rounds`), on
    the decode thread before it serves; the cache is cleared after. No size past
    `most_rows`, the most logit rows a step of this daemon has: llama.cpp aborts the
    process on a batch with more outputs than its context's n_outputs_max (a daemon
    with 2 slots and draft_max 8 died so at start-up). Under the keys below 1, what
    rows add by the context they attend to, and a prompt row's cost."""
    sizes = tuple(size for size in sizes if size + _PROMPT_TOKENS <= model.n_batch
                  and size <= most_rows)
    most = max(sizes)
    batch = C.llama_batch_init(_PROMPT_TOKENS + max(most, _PROMPT_ROWS + 1), 0, 1)
    n_vocab = model.info.n_vocab
    shuffle = random.Random(0).shuffle
    best: dict[int, float] = {}
    try:
        at_depth = _depth_costs(model, batch, rows=min(_DEPTH_ROWS, most), sizes=sizes,
                                rounds=rounds, most=most)
        for row in range(_PROMPT_TOKENS + most):
            _put(batch, row, row * 7919 % (n_vocab - 1) + 1, row, 0)  # any valid ids do
        batch.n_tokens = _PROMPT_TOKENS
        if C.llama_decode(model.ctx, batch) != 0:
            return {}
        prompt_only = _PROMPT_TOKENS
        prompt_step = model.n_batch >= _PROMPT_TOKENS + _PROMPT_ROWS + 1
        prompt_ns = float("inf")
        for _ in range(rounds):
            for row in range(most):
                _put(batch, row, row * 7919 % (n_vocab - 1) + 1, prompt_only + row, 1)
            order = list(sizes)
            shuffle(order)
            for size in order:
                elapsed = _timed_step(model, batch, size, prompt_only)
                if elapsed is None:
                    return {}
                best[size] = min(best.get(size, elapsed), elapsed)
            elapsed = _prompt_step(model, batch, prompt_only) if prompt_step else None
            if elapsed is not None:
                prompt_ns = min(prompt_ns, elapsed)
    finally:
        C.llama_batch_free(batch)
        C.llama_memory_clear(model.memory, False)
    shallow = (best[1], best.get(min(_DEPTH_ROWS, most), 0.0), prompt_ns)
    if prompt_ns < float("inf"):
        best[PROMPT_ROW_KEY] = max(0.0, (prompt_ns - best[1]) / _PROMPT_ROWS)
    for near, (depth_from, before), (depth_to, after) in zip(
            (True, False), [(_PROMPT_TOKENS, shallow), *at_depth], at_depth, strict=False):
        cells = depth_to - depth_from
        logit_key, prompt_key = ((DEPTH_KEY, PROMPT_CELL_KEY) if near
                                 else (FAR_DEPTH_KEY, FAR_PROMPT_CELL_KEY))
        rows = min(_DEPTH_ROWS, most)
        best[logit_key] = max(0.0, ((after[1] - after[0]) - (before[1] - before[0]))
                              / ((rows - 1) * cells))
        if before[2] < float("inf") and after[2] < float("inf"):
            best[prompt_key] = max(0.0, ((after[2] - after[0]) - (before[2] - before[0]))
                                   / (_PROMPT_ROWS * cells))
    return best


def _depth_costs(model: Model, batch: object, *, rows: int, sizes: tuple[int, ...],
                 rounds: int, most: int) -> list[tuple[int, tuple[float, float, float]]]:
    """At DEPTH cells of context, and for a model with sliding-window layers at twice
    that too (past the window only its other layers' rows cost more by the cell): the
    ns of a one-row step, of a `rows`-row step and of a one-row step with _PROMPT_ROWS
    prompt rows (_prompt_step; inf where the context or batch cannot hold it), the
    fastest of `rounds`. Empty where it cannot be measured (a context or batch too
    small). The cache is cleared after."""
    if rows < 2 or DEPTH + rows > model.n_ctx or rows not in sizes:
        return []
    depths = [DEPTH]
    if C.llama_model_n_swa(model.model) > 0 and 2 * DEPTH + rows <= model.n_ctx:
        depths.append(2 * DEPTH)
    chunk = min(model.n_batch, _PROMPT_TOKENS + most)
    n_vocab = model.info.n_vocab
    measured: list[tuple[int, tuple[float, float, float]]] = []
    filled = 0
    try:
        for depth in depths:
            for start in range(filled, depth, chunk):
                count = min(chunk, depth - start)
                for row in range(count):
                    _put(batch, row, (start + row) * 7919 % (n_vocab - 1) + 1, start + row, 0)
                batch.n_tokens = count  # type: ignore[attr-defined]
                if C.llama_decode(model.ctx, batch) != 0:
                    return measured
            filled = depth
            prompt_step = (model.n_ctx >= depth + _PROMPT_ROWS + 1
                           and model.n_batch >= _PROMPT_ROWS + 1)
            times = [float("inf")] * 3
            for _ in range(rounds):
                for index, size in enumerate((1, rows)):
                    for row in range(size):
                        _put(batch, row, row * 104729 % (n_vocab - 1) + 1, depth + row, 1)
                    elapsed = _timed_step(model, batch, size, depth)
                    if elapsed is None:
                        return measured
                    times[index] = min(times[index], elapsed)
                elapsed = _prompt_step(model, batch, depth) if prompt_step else None
                if elapsed is not None:
                    times[2] = min(times[2], elapsed)
            measured.append((depth, (times[0], times[1], times[2])))
    finally:
        C.llama_memory_clear(model.memory, False)
    return measured


def _timed_step(model: Model, batch: object, rows: int, kept: int) -> int | None:
    """The ns of one llama_decode of the batch's first `rows` rows, whose cells are then
    dropped (the context keeps its first `kept`); None if the decode failed."""
    b: Any = batch
    b.n_tokens = rows
    started = time.perf_counter_ns()
    status = C.llama_decode(model.ctx, batch)
    C.llama_synchronize(model.ctx)
    elapsed = time.perf_counter_ns() - started
    C.llama_memory_seq_rm(model.memory, 0, kept, -1)
    return elapsed if status == 0 else None


def _prompt_step(model: Model, batch: object, kept: int) -> int | None:
    """The ns of a step of _PROMPT_ROWS prompt rows and one logit row after `kept` cells
    (the shape of a step that reads a prompt beside one stream), as _timed_step."""
    n_vocab = model.info.n_vocab
    rows = _PROMPT_ROWS + 1
    for row in range(rows):
        _put(batch, row, (kept + row) * 31 % (n_vocab - 1) + 1, kept + row, int(row == rows - 1))
    return _timed_step(model, batch, rows, kept)


def _put(batch: object, row: int, token: int, pos: int, logits: int) -> None:
    b: Any = batch
    b.token[row] = token
    b.pos[row] = pos
    b.n_seq_id[row] = 1
    b.seq_id[row][0] = 0
    b.logits[row] = logits


def step_costs_key(model_path: str, n_threads: int, context: tuple[object, ...]) -> str:
    """What the costs depend on: the model file, the build and the CPU (llama.cpp's
    system info names its features), the threads and the context's settings."""
    stat = os.stat(model_path)
    parts = (os.path.abspath(model_path), stat.st_size, stat.st_mtime_ns,
             C.llama_print_system_info().decode(errors="replace"), n_threads, SIZES,
             *context)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def costs_folder(cache: CacheConfig) -> Path:
    """Beside the prompt store's folder: `[cache] dir`'s parent, else the daemon's
    cache folder ($CACHE_DIRECTORY or ~/.cache/sfcore-ai)."""
    if cache.dir:
        return Path(os.path.expanduser(cache.dir)).parent / "step-costs"
    return cache_dir() / "step-costs"


class BusyMeter:
    """Other processes' share of the machine's CPUs between `__init__` and `share()`:
    the system's busy time less this process's own, over the CPUs' time."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._process = psutil.Process()
        self._start = self._readings()

    def share(self) -> float:
        system0, own0, wall0 = self._start
        system1, own1, wall1 = self._readings()
        cpus = self._psutil.cpu_count() or 1
        return max(system1 - system0 - (own1 - own0), 0.0) / max((wall1 - wall0) * cpus, 1e-9)

    def _readings(self) -> tuple[float, float, float]:
        times = self._psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        own = self._process.cpu_times()
        return busy, own.user + own.system, time.monotonic()
