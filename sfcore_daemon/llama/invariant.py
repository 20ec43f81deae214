"""Row-invariant kernels: a row's logits the same whatever else its batch holds.

On the CPU a token's logits depended on its batch: flash attention sums a query row's
cells in another order alone (split across threads past 512 cells), beside a few
rows, and in a prompt chunk (tiles); the repacked, tiled and sgemm matmuls sum a row
otherwise than the one-row dot product; and a sequence's cells sat wherever the pool
had room, so attention met them in an order other traffic decided. Greedy bytes then
moved with speculation, load and prompt caching, and a seed did not repeat.

The project's llama.cpp patches (scripts/llama-patches/cpu-row-invariant.patch,
repack-row-invariant.patch, kv-position-order.patch) give every op its one-row path
and keep each sequence's cells in position order when GGML_CPU_ROW_INVARIANT=1 is in
the environment as llama.cpp's CPU backend starts (it reads it once). `enable` sets it
before the daemon's first llama.cpp call; docs/performance/reproducible.md has the cost.
"""

from __future__ import annotations

import os
from typing import Final

ENV: Final = "GGML_CPU_ROW_INVARIANT"


def enable(on: bool) -> None:
    """Ask for the row-invariant kernels (or not) before llama.cpp's backend starts;
    later calls change nothing llama.cpp has already read."""
    os.environ[ENV] = "1" if on else "0"


def row_invariant() -> bool:
    """Whether the kernels in force were asked to be row-invariant."""
    return os.environ.get(ENV) == "1"
