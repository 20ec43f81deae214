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

from sfcore_daemon.llama.logitrow import row_view

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


# The row is viewed as this many rows of n_vocab // _GROUPS columns to find its best
# tokens without sorting it (RowLogprobs._best).
_GROUPS = 64


class RowLogprobs:
    """Scratch buffers for one vocabulary, reused for every row."""

    __slots__ = ("_above", "_columns", "_exps", "_maxima", "_n_vocab", "_np", "_offsets",
                 "_ranked", "_sums", "_tail", "_width")

    def __init__(self, n_vocab: int) -> None:
        # Imported beside the model load already (sampling.import_numpy_beside): this
        # only looks it up; the daemon does not import numpy before that.
        import numpy

        self._np = numpy
        self._n_vocab = n_vocab
        self._exps = numpy.empty(n_vocab, numpy.float32)
        width = self._width = n_vocab // _GROUPS
        self._maxima = numpy.empty(width, numpy.float32)
        self._sums = numpy.empty(width, numpy.float32)
        self._ranked = numpy.empty(width, numpy.float32)
        self._above = numpy.empty(width, numpy.bool_)
        self._offsets = (numpy.arange(_GROUPS) * width)[:, None]
        self._tail = numpy.arange(_GROUPS * width, n_vocab)  # ids past the last whole row
        self._columns = numpy.arange(width)

    def of_row(self, ctx: Any, row: int, token: int, top: int) -> RowNumbers:
        """The numbers of `token` chosen from the logits of output row `row` of `ctx`."""
        return self.of(row_view(ctx, row, self._n_vocab), token, top)

    def copy_row(self, ctx: Any, row: int) -> npt.NDArray[np.float32]:
        """A copy of a logits row, for numbers taken after the next step (a wide pass)."""
        return row_view(ctx, row, self._n_vocab).copy()

    def of(self, logits: npt.NDArray[np.float32], token: int, top: int) -> RowNumbers:
        """The numbers of `token` chosen from `logits`, with the `top` likeliest."""
        np, exps = self._np, self._exps
        peak = float(logits.max())
        # log-sum-exp shifted by the peak: exp never overflows, the largest term is 1.
        np.subtract(logits, peak, out=exps)
        np.exp(exps, out=exps)
        # Summed as _GROUPS rows added column-wise, then the columns: about twice as fast as
        # numpy's sum of the whole row (docs/performance/logprobs.md).
        whole = _GROUPS * self._width
        np.sum(exps[:whole].reshape(_GROUPS, self._width), axis=0, out=self._sums)
        norm = peak + math.log(float(self._sums.sum()) + float(exps[whole:].sum()))
        chosen = float(logits[token]) - norm
        if top <= 0:
            return chosen, [], []
        ids, values = self._best(logits, top)
        # Each as float(logit) - norm, as `chosen` is: for a greedy token its logprob
        # and the first alternative's are the same number.
        return chosen, ids.tolist(), [value - norm for value in values.tolist()]

    def _best(self, logits: npt.NDArray[np.float32],
              top: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.float32]]:
        """The ids and logits of the `top` best tokens, best first (equal: lower id).

        The row as _GROUPS rows of `width` columns: a column's maximum is the best of its
        tokens. The `top` best maxima are `top` distinct tokens, so the top-th best token
        is at least as good as the top-th best maximum, and every token that good lies
        in a column whose maximum reaches it: only those columns (usually `top` of them,
        64 tokens each) are ranked. One vectorised pass over the row instead of a partial
        sort of all of it (docs/performance/logprobs.md)."""
        np, width = self._np, self._width
        if width < 4 * top:  # a small vocabulary: all of it
            ids = np.arange(self._n_vocab)
        else:
            maxima, ranked, above = self._maxima, self._ranked, self._above
            np.max(logits[:_GROUPS * width].reshape(_GROUPS, width), axis=0, out=maxima)
            np.copyto(ranked, maxima)
            kth = width - top
            ranked.partition(kth)
            np.greater_equal(maxima, ranked[kth], out=above)
            ids = (self._offsets + self._columns[above]).ravel()
            if len(self._tail):
                ids = np.concatenate((ids, self._tail))
        values = logits[ids]
        if len(ids) > top:  # those at least as good as the top-th best among them
            ranked_values = values.copy()
            kth = len(values) - top
            ranked_values.partition(kth)
            kept = values >= ranked_values[kth]
            ids, values = ids[kept], values[kept]
        order = np.lexsort((ids, -values))[:top]
        return ids[order], values[order]
