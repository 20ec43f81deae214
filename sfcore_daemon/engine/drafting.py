"""A step's drafts (speculative.py), on the decode thread: each speculating sequence's
share of the step's draft rows, then their lengths rounded so that the step's logit
rows are a multiple of [speculative] row_multiple.

The rounding needs every logit row of the step: each generating sequence's pending
token, the drafts, and the last row of each prompt the step finishes. So the step loop
proposes the drafts first, plans its prompt chunks in the rows they leave, and only
then settles the drafts' lengths; `logit_rows` counts the rows of the batch as it is
submitted, for the `aligned_steps` figure.
"""

from __future__ import annotations

import ctypes
from typing import Any

from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.engine.speculative import MIN_DRAFT, DraftSettings, aligned_lengths


class DraftPlan:
    """The drafts proposed for one step, until `settle` gives them their lengths."""

    __slots__ = ("_settings", "_drafting", "_lengths", "_spare", "rows")

    def __init__(self, settings: DraftSettings, draft_rows: int, stepping: list[Seq]) -> None:
        """The step's `draft_rows` shared evenly among the `stepping` sequences."""
        self._settings = settings
        spare = draft_rows  # draft rows left in this step
        sharing = len(stepping)  # sequences still to get a share of them
        self._drafting: list[tuple[Seq, list[int]]] = []
        self._lengths: list[int] = []
        for seq in stepping:
            share = spare // sharing
            sharing -= 1
            drafter = seq.drafter
            if drafter is None or share < MIN_DRAFT:
                continue
            # Never past max_tokens: the last token sampled is never decoded, so the
            # draft cells stay within the job's KV reservation. The continuation may
            # run past the share by what aligning could add.
            room = min(seq.limit - seq.n_out - 1, share + settings.row_multiple - 1)
            continuation, length = drafter.propose(room)
            length = min(length, share)
            if length:
                self._drafting.append((seq, continuation))
                self._lengths.append(length)
                spare -= length
        self._spare = spare
        self.rows = sum(self._lengths)  # the draft rows proposed

    def settle(self, rows: int, room: int) -> None:
        """Each drafting sequence's `draft`, its length rounded so that the step's logit
        rows come to a multiple of row_multiple (speculative.aligned_lengths). `rows`:
        the step's other logit rows (pending tokens, finished prompts); `room`: the
        batch rows the step leaves free."""
        if not self._drafting:
            return
        lengths = aligned_lengths(rows, self._lengths,
                                  [len(continuation) for _, continuation in self._drafting],
                                  self._settings.row_multiple, min(self._spare, room))
        for (seq, continuation), length in zip(self._drafting, lengths, strict=True):
            if length:
                seq.draft = continuation[:length]


def logit_rows(batch: Any, n: int) -> int:
    """The rows of the first `n` of `batch` that ask for logits, as llama.cpp reads them."""
    return n - ctypes.string_at(batch.logits, n).count(0)


def count_aligned(drafted: list[Seq], rows: int, multiple: int) -> None:
    """A verifying step's figures, on each drafting job: it drafted, the step's logit
    rows (`rows`, as submitted), and whether they were a multiple of row_multiple."""
    aligned = rows % multiple == 0
    for seq in drafted:
        job = seq.job
        assert job is not None
        job.draft_steps += 1
        job.aligned_steps += aligned
        job.logit_rows += rows
