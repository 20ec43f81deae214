"""What a section is given: the parsed options, the params every launcher takes (the model
file, context, threads), the header line of its tables, and how to run a coroutine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bench:
    """`params`: model (the GGUF path, the daemon's and every peer's), n_ctx, n_threads,
    n_threads_batch, tokens, slots (None: the daemon's default), llama_server_kv.
    `runner`: runs a coroutine to completion on a fresh event loop (uvloop.run)."""

    args: argparse.Namespace
    params: dict[str, Any]
    header: str
    runner: Callable[[Any], Any]

    @property
    def runs(self) -> int:
        runs: int = self.args.runs
        return runs

    @property
    def llama_server(self) -> str | None:
        path: str | None = self.args.llama_server
        return path
