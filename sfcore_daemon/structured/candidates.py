"""The grammar sampler's slow path (grammar.py): every token of the vocabulary as a
candidate, cut to the likeliest by top-k tiers, masked by the grammar, then drawn by the
request's own chain.

A grammar pass over the whole vocabulary costs several decode steps, and far more inside
a JSON string (docs/performance/design.md, "Structured output"). So the pass covers the
most likely tokens first, in growing tiers
(RESAMPLE_TIERS), and the whole vocabulary only when the grammar allows none of those;
the draw is then among the allowed tokens of that tier.
"""

from __future__ import annotations

import array
import ctypes
import math
from collections.abc import Iterable
from typing import Any, Final

from sfcore_daemon.llama.capi import C

# How many of the likeliest tokens the slow path runs the grammar over, tier by tier,
# before the whole vocabulary; costs in docs/performance/design.md, "Structured output".
RESAMPLE_TIERS: Final = (128, 2048, 32768)

_token_data_p = ctypes.POINTER(C.llama_token_data)
_ids_cache: dict[int, bytes] = {}


def id_template(n_vocab: int) -> bytes:
    """llama_token_data[n_vocab] holding ids 0..n-1 (logits and p zero), as bytes."""
    template = _ids_cache.get(n_vocab)
    if template is None:
        raw = bytearray(ctypes.sizeof(C.llama_token_data) * n_vocab)
        memoryview(raw).cast("i")[0::3] = memoryview(array.array("i", range(n_vocab)))
        template = _ids_cache[n_vocab] = bytes(raw)
    return template


def is_hidden(vocab: Any, token: int) -> bool:
    """A control token other than end-of-generation (its piece is empty)."""
    return bool(C.llama_vocab_is_control(vocab, token)) and not C.llama_vocab_is_eog(
        vocab, token)


_EMPTY: Final[memoryview[Any]] = memoryview(b"")


class Candidates:
    """One request's candidate array over the whole vocabulary (3 MB at 262,144 tokens,
    made on its first slow draw) and the top-k samplers of the tiers."""

    __slots__ = ("_vocab", "_n_vocab", "_tops", "_raw", "_array", "_floats", "_ids")

    def __init__(self, vocab: Any, n_vocab: int) -> None:
        self._vocab = vocab
        self._n_vocab = n_vocab
        self._tops: list[Any] | None = None
        self._raw: bytearray | None = None
        self._array: Any = None
        self._floats: memoryview[Any] = _EMPTY
        self._ids: memoryview[Any] = _EMPTY

    def mask(self, logits: bytes, tier: int | None, grammar: Any) -> bool:
        """Every token with its logit from `logits`, cut to the likeliest of RESAMPLE_TIERS
        [`tier`] (None: the whole vocabulary), then masked by `grammar`: whether the
        grammar allows any of them."""
        if self._tops is None:
            self._tops = [C.llama_sampler_init_top_k(n) for n in RESAMPLE_TIERS]
        array, floats = self._fill(logits)
        if tier is not None:
            C.llama_sampler_apply(self._tops[tier], ctypes.byref(array))
        C.llama_sampler_apply(grammar, ctypes.byref(array))
        return bool(max(floats[1:3 * array.size:3]) != -math.inf)

    def draw(self, chain: Any, penalties: Any, history: Iterable[int]) -> int:
        """Run `chain` over the masked candidates (`penalties`, its repeat penalty, first
        rebuilt from `history`: the chain has already recorded a token the grammar
        rejects). The token drawn, not yet accepted by anything; -1 when the chain
        chose nothing the grammar allows."""
        if penalties is not None:
            C.llama_sampler_reset(penalties)
            for past in history:
                C.llama_sampler_accept(penalties, past)
        array, floats, ids = self._array, self._floats, self._ids
        size, raw = array.size, self._raw
        assert raw is not None  # _fill made it
        masked = bytes(raw[:12 * size])
        while True:
            # top_k trusts a sorted flag and would cut the masked array as it stands.
            array.sorted = False
            array.selected = -1
            C.llama_sampler_apply(chain, ctypes.byref(array))
            selected = array.selected
            if not 0 <= selected < array.size or floats[3 * selected + 1] == -math.inf:
                return -1
            token: int = ids[3 * selected]
            if not is_hidden(self._vocab, token):
                return token
            # A control token matches the grammar by its special text, yet is streamed
            # as nothing: masked, and the chain draws again from the grammar's choice.
            raw[:12 * size] = masked
            array.size = size
            position = ids[0:3 * size:3].tolist().index(token)
            floats[3 * position + 1] = -math.inf
            masked = bytes(raw[:12 * size])

    def _fill(self, logits: bytes) -> tuple[Any, memoryview]:
        """Every token with its logit, as llama_sampler_sample builds them, at C speed:
        one copy of the ids, then the logits' bytes into their strided slots (a Python
        loop would cost many times more: docs/performance/design.md)."""
        n = self._n_vocab
        if self._raw is None:
            self._raw = bytearray(id_template(n))
            buffer = (C.llama_token_data * n).from_buffer(self._raw)
            self._array = C.llama_token_data_array(
                ctypes.cast(buffer, _token_data_p), n, -1, False)
            self._floats = memoryview(self._raw).cast("f")
            self._ids = memoryview(self._raw).cast("i")
        else:
            self._raw[:] = id_template(n)
        raw, array = self._raw, self._array
        stride = ctypes.sizeof(C.llama_token_data)
        for byte in range(4):
            raw[4 + byte::stride] = logits[byte::4]
        array.size = n
        array.selected = -1
        array.sorted = False
        return array, self._floats

    def free(self) -> None:
        for top in self._tops or ():
            C.llama_sampler_free(top)
        self._tops = None
        # The 3 MB buffer goes now, not when the job is collected.
        self._floats = self._ids = _EMPTY
        self._raw = self._array = None
