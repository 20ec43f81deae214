"""What a decode step of r logit rows costs on this model, machine and build: measured
once, before the daemon serves, for the draft gate (engine/draftgate.py), and kept in
the cache folder so that later starts read it instead.

One sequence after a short prompt, every row asking for logits (the shape of a step
that verifies a draft), on the daemon's own threads; each size the fastest of a few
rounds, in a shuffled order each round. Then the same after DEPTH cells of context: each
verification row attends over the whole context, so a draft costs more at depth than its
rows' share of the weights, and what one row adds per cell is kept under DEPTH_KEY.
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
# The costs' key for the ns one logit row adds per cell of context (draftgate.StepCosts).
DEPTH_KEY = 0
# Other processes' share of the CPUs during the measurement above which it is not kept.
BUSY_SHARE = 0.1
_PROMPT_TOKENS = 8


def measure_step_costs(model: Model, sizes: tuple[int, ...] = SIZES,
                       rounds: int = ROUNDS, *, most_rows: int) -> dict[int, float]:
    """rows -> ns of one llama_decode of that many rows (the fastest of `rounds`), on
    the decode thread before it serves; the cache is cleared after. No size past
    `most_rows`, the most logit rows a step of this daemon has: llama.cpp aborts the
    process on a batch with more outputs than its context's n_outputs_max (a daemon
    with 2 slots and draft_max 8 died so at start-up)."""
    sizes = tuple(size for size in sizes if size + _PROMPT_TOKENS <= model.n_batch
                  and size <= most_rows)
    most = max(sizes)
    batch = C.llama_batch_init(_PROMPT_TOKENS + most, 0, 1)
    n_vocab = model.info.n_vocab
    shuffle = random.Random(0).shuffle
    best: dict[int, float] = {}
    try:
        depth_ns = _depth_cost(model, batch, sizes, rounds, most)
        for row in range(_PROMPT_TOKENS + most):
            batch.token[row] = row * 7919 % (n_vocab - 1) + 1  # any valid ids do
            batch.pos[row] = row
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = 0
            batch.logits[row] = 0
        batch.n_tokens = _PROMPT_TOKENS
        if C.llama_decode(model.ctx, batch) != 0:
            return {}
        prompt_only = _PROMPT_TOKENS
        for row in range(most):
            batch.token[row] = batch.token[prompt_only + row]
            batch.pos[row] = prompt_only + row
            batch.logits[row] = 1
        for _ in range(rounds):
            order = list(sizes)
            shuffle(order)
            for size in order:
                elapsed = _timed_step(model, batch, size, prompt_only)
                if elapsed is None:
                    return {}
                best[size] = min(best.get(size, elapsed), elapsed)
    finally:
        C.llama_batch_free(batch)
        C.llama_memory_clear(model.memory, False)
    if best and depth_ns is not None:
        rows = min(_DEPTH_ROWS, most)
        shallow = best[rows] - best[1]
        best[DEPTH_KEY] = max(0.0, (depth_ns[1] - depth_ns[0] - shallow)
                              / ((rows - 1) * (DEPTH - _PROMPT_TOKENS)))
    return best


def _depth_cost(model: Model, batch: object, sizes: tuple[int, ...], rounds: int,
                most: int) -> tuple[float, float] | None:
    """The ns of a one-row step and of a _DEPTH_ROWS-row step (fewer if `most` is less)
    after DEPTH cells of context, the fastest of `rounds`; None where it cannot be
    measured (a context or batch too small). The cache is cleared after."""
    rows = min(_DEPTH_ROWS, most)
    if rows < 2 or DEPTH + rows > model.n_ctx or rows not in sizes:
        return None
    chunk = min(model.n_batch, _PROMPT_TOKENS + most)
    n_vocab = model.info.n_vocab
    times = [float("inf"), float("inf")]
    try:
        for start in range(0, DEPTH, chunk):
            count = min(chunk, DEPTH - start)
            for row in range(count):
                _put(batch, row, (start + row) * 7919 % (n_vocab - 1) + 1, start + row, 0)
            batch.n_tokens = count  # type: ignore[attr-defined]
            if C.llama_decode(model.ctx, batch) != 0:
                return None
        for _ in range(rounds):
            for index, size in enumerate((1, rows)):
                for row in range(size):
                    _put(batch, row, row * 104729 % (n_vocab - 1) + 1, DEPTH + row, 1)
                elapsed = _timed_step(model, batch, size, DEPTH)
                if elapsed is None:
                    return None
                times[index] = min(times[index], elapsed)
    finally:
        C.llama_memory_clear(model.memory, False)
    return times[0], times[1]


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
