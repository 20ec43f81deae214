"""Log-probabilities of a logits row: the numbers behind a request's `logprobs`.

The model's own distribution over the whole vocabulary (temperature 1, before any
penalty or grammar mask): logprob(t) = logit(t) - log(sum(exp(logits))). For the token a
row chose, and for the row's `top` likeliest tokens, best first (equal logits: the lower
id first). Computed with numpy over a view of llama.cpp's logits row (no copy of it)
and buffers allocated once; only the small result is new. Decode thread only (a wide
grammar pass has an instance of its own).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

from sfcore_daemon.llama.capi import C

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# A row's numbers: the chosen token's logprob, then the top alternatives' ids and
# logprobs (empty for logprobs 0), best first.
RowNumbers = tuple[float, list[int], list[float]]


class TokenLogprobs(NamedTuple):
    """What the decode thread keeps per token of a request that asks (Job.numbers): the
    token, the row's numbers, and the alternatives' bytes from the model's cache of token pieces
    (the event loop cannot safely fill that cache)."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    top_pieces: list[bytes]


class RowLogprobs:
    """Scratch buffers for one vocabulary, reused for every row."""

    __slots__ = ("_above", "_exps", "_n_vocab", "_np", "_ranked")

    def __init__(self, n_vocab: int) -> None:
        # Imported beside the model load already (sampling.import_numpy_beside): this
        # only looks it up; the daemon does not import numpy before that.
        import numpy

        self._np = numpy
        self._n_vocab = n_vocab
        self._exps = numpy.empty(n_vocab, numpy.float32)
        self._ranked = numpy.empty(n_vocab, numpy.float32)
        self._above = numpy.empty(n_vocab, numpy.bool_)

    def of_row(self, ctx: Any, row: int, token: int, top: int) -> RowNumbers:
        """The numbers of `token` chosen from the logits of output row `row` of `ctx`."""
        logits = self._np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, row),
                                             shape=(self._n_vocab,))
        return self.of(logits, token, top)

    def copy_row(self, ctx: Any, row: int) -> npt.NDArray[np.float32]:
        """A copy of a logits row, for numbers taken after the next step (a wide pass)."""
        return self._np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, row),
                                           shape=(self._n_vocab,)).copy()

    def of(self, logits: npt.NDArray[np.float32], token: int, top: int) -> RowNumbers:
        """The numbers of `token` chosen from `logits`, with the `top` likeliest."""
        np, exps = self._np, self._exps
        peak = float(logits.max())
        # log-sum-exp shifted by the peak: exp never overflows, the largest term is 1.
        np.subtract(logits, peak, out=exps)
        np.exp(exps, out=exps)
        norm = peak + math.log(float(exps.sum()))
        chosen = float(logits[token]) - norm
        if top <= 0:
            return chosen, [], []
        # The top-th largest logit, by an in-place partial sort of a copy; then every
        # token at or above it (ties may add a few), ordered best first, ids ascending.
        ranked = self._ranked
        np.copyto(ranked, logits)
        kth = self._n_vocab - top
        ranked.partition(kth)
        above = self._above
        np.greater_equal(logits, ranked[kth], out=above)
        ids = np.flatnonzero(above)
        values = logits[ids]
        order = np.lexsort((ids, -values))[:top]
        # Each as float(logit) - norm, as `chosen` is: for a greedy token its logprob
        # and the first alternative's are the same number.
        return (chosen, ids[order].tolist(),
                [value - norm for value in values[order].tolist()])
