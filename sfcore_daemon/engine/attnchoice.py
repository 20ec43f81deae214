"""The attention a long prompt's full steps take, by `[model] matmul_attention`
(llama/attnprobe.py): read from the kept file on the event loop at the start, measured
on the decode thread before the context is made when none fits, kept again on the event
loop once the daemon is ready."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.engine import costsfile
from sfcore_daemon.llama import attnprobe
from sfcore_daemon.llama.attnprobe import Range, Shape
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.ctxsize import head_widths
from sfcore_daemon.llama.gpu import gpu_layers
from sfcore_daemon.llama.model import model_meta
from sfcore_daemon.llama.stepcost import BUSY_SHARE, BusyMeter, step_costs_key

log = logging.getLogger(__name__)


class AttentionChoice:
    """Flash attention or matrix products for a long prompt's full steps: what `choose`
    decided (`range`, None: flash attention for every step) and how."""

    def __init__(self, config: ModelConfig, model_path: str, n_threads: int) -> None:
        self._config = config
        self._model_path = model_path
        self._n_threads = n_threads
        self._path: Path | None = None
        self._kept: bytes | None = None
        self._measured: bytes | None = None
        self.range: Range | None = None
        self.how = "off"

    def read(self, folder: Path | None) -> None:
        """Read the file kept in `folder` (beside the step costs; None: none is kept),
        where a new measurement is kept too (event loop, before the decode thread starts)."""
        if folder is None:
            return
        # What the choice depends on beyond what the kept file says (attnprobe.Kept).
        key = step_costs_key(self._model_path, self._n_threads, ("attention",))
        path = self._path = folder / f"attention-{key}.json"
        if self._config.matmul_attention == "auto":
            try:
                with open(path, "rb") as file:
                    self._kept = file.read(attnprobe.MAX_BYTES + 1)
            except OSError:
                self._kept = None

    def choose(self, model: Any, n_ctx: int) -> None:
        """Decide and name the range to llama.cpp: on the decode thread, after the model
        is loaded and before its context is made (whose compute buffer is sized by it)."""
        config = self._config
        n_ubatch = min(config.n_ubatch, config.n_batch, n_ctx)
        if (config.matmul_attention == "off" or config.flash_attn is False
                or config.reproducible or gpu_layers(config.n_gpu_layers) != 0):
            self.how = "off" if config.matmul_attention == "off" else "not used"
        else:
            shape = model_shape(model, n_ubatch)
            if config.matmul_attention == "on":
                self.range = Range(n_ubatch, 0, attnprobe.most_cells(shape, n_ctx))
                self.how = "on"
            else:
                self._auto(shape, n_ctx, self._n_threads)
        attnprobe.apply(self.range)

    def _auto(self, shape: Shape, n_ctx: int, n_threads: int) -> None:
        kept = attnprobe.parse(self._kept, shape, n_ctx) if self._kept is not None else None
        if kept is not None:
            self.range, self.how = kept.range, "kept"
            return
        busy = BusyMeter()
        timings = attnprobe.measure(shape, n_ctx, n_threads)
        self.range = attnprobe.choose(shape.rows, timings)
        if not timings:
            self.how = "not measured: ggml's libraries did not load"
        elif busy.share() > BUSY_SHARE:
            self.how = "measured while the machine was busy, for this run only"
        else:
            self.how = "measured"
            self._measured = attnprobe.encode(shape, n_ctx, self.range)

    def save(self) -> None:
        """Log the choice and keep a new measurement (event loop, after `ready`)."""
        found = self.range
        log.info("matmul attention (%s): %s", self.how,
                 f"steps of {found.rows} prompt rows over {found.first}-{found.last} cells"
                 if found is not None else "none")
        if self._measured is None or self._path is None:
            return
        data, self._measured = self._measured, None
        try:
            costsfile.write_atomically(self._path, data)
            log.info("matmul attention choice kept for later starts in %s", self._path)
        except OSError as exc:
            log.warning("could not keep the attention choice in %s: %s", self._path, exc)


def model_shape(model: Any, rows: int) -> Shape:
    """The model's attention heads and head sizes, for a step of `rows` prompt rows."""
    head_k, head_v = head_widths(model, functools.partial(model_meta, model))
    return Shape(max(C.llama_model_n_head(model), 1), max(C.llama_model_n_head_kv(model), 1),
                 min(max(head_k, 1), 4096), min(max(head_v, 1), 4096), rows)
