"""How many tokens the context holds when `[model] n_ctx = 0` (the default): what the
model was trained for, as far as the KV budget allows.

The KV cache is the part of a context that grows with it: every layer keeps a key and a
value vector per KV head and token, in F16 (the daemon's cache type). The daemon keeps a
full-size sliding-window cache (`swa_full`, model.py), so window layers cost what the
others do, and one pool serves every slot (`kv_unified`), so the budget is for the
whole pool, not per slot. The budget is `[model] kv_budget_mb`, or a quarter of the
machine's memory when that is 0: the weights, the compute buffers, the prompt store's
RAM tier (a sixteenth by default) and the rest of the desktop keep the other three.
"""

from __future__ import annotations

import os
from typing import Any, Final, NamedTuple

from sfcore_daemon.llama.capi import C

F16_BYTES: Final = 2
# Contexts are sized in whole multiples of this (llama.cpp pads its KV views to 256).
CTX_STEP: Final = 256
MIB: Final = 1 << 20


class ContextSize(NamedTuple):
    n_ctx: int
    n_ctx_train: int
    kv_bytes_per_token: int
    budget_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.n_ctx * self.kv_bytes_per_token

    def line(self) -> str:
        """For the start-up log."""
        return (f"context {self.n_ctx} tokens (trained for {self.n_ctx_train}; KV "
                f"{self.kv_bytes / MIB:.0f} MiB at {self.kv_bytes_per_token} bytes a token, "
                f"budget {self.budget_bytes / MIB:.0f} MiB)")


def kv_bytes_per_token(model: Any, meta: Any) -> int:
    """K and V of every layer and KV head, F16. `meta(key)`: a GGUF metadata value or
    None (model.model_meta); a head's key and value widths come from `<arch>.attention.
    key_length`/`value_length` when the file has them, else n_embd / n_head."""
    key, value = head_widths(model, meta)
    n_kv: int = max(1, C.llama_model_n_head_kv(model))
    n_layer: int = C.llama_model_n_layer(model)
    return n_layer * n_kv * (key + value) * F16_BYTES


def head_widths(model: Any, meta: Any) -> tuple[int, int]:
    """A head's key and value widths (see kv_bytes_per_token)."""
    n_head = max(1, C.llama_model_n_head(model))
    head = C.llama_model_n_embd(model) // n_head
    architecture = meta("general.architecture") or ""
    return (_int(meta(f"{architecture}.attention.key_length"), head),
            _int(meta(f"{architecture}.attention.value_length"), head))


def budget_bytes(kv_budget_mb: int) -> int:
    if kv_budget_mb:
        return kv_budget_mb * MIB
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


def choose(n_ctx: int, n_ctx_train: int, per_token: int, budget: int) -> int:
    """The context to create: `n_ctx` when set (not 0); else the trained context, cut to
    the budget in whole CTX_STEPs (never below one step, nor above the trained one)."""
    if n_ctx:
        return n_ctx
    trained = n_ctx_train if n_ctx_train > 0 else CTX_STEP
    fits = budget // max(1, per_token)
    if trained <= fits:
        return trained
    return max(min(CTX_STEP, trained), fits - fits % CTX_STEP)


def context_size(model: Any, meta: Any, n_ctx: int, kv_budget_mb: int) -> ContextSize:
    per_token = kv_bytes_per_token(model, meta)
    budget = budget_bytes(kv_budget_mb)
    trained = C.llama_model_n_ctx_train(model)
    return ContextSize(choose(n_ctx, trained, per_token, budget), trained, per_token, budget)


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default
