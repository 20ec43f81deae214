"""A step's drafts (speculative.py), on the decode thread: each speculating sequence's
share of the step's draft rows, then their lengths rounded so that the step's logit
rows are a multiple of [speculative] row_multiple.

A sequence with a JSON schema drafts the text its grammar forces first (forced drafts,
structured/forced.py), and inside a string value the prompt text the value copies
(structured/copying.py); its n-gram drafts are cut where the document would refuse
them. Verification (rows.py) treats every draft alike.

The rounding needs every logit row of the step: each generating sequence's pending
token, the drafts, and the last row of each prompt the step finishes. So the step loop
proposes the drafts first, plans its prompt chunks in the rows they leave, and only
then settles the drafts' lengths; `logit_rows` counts the rows of the batch as it is
submitted, for the `aligned_steps` figure.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

from sfcore_daemon.engine.draftgate import StepCosts, best_length, expected_tokens
from sfcore_daemon.engine.sequence import NO_PARTS, DraftParts, Seq
from sfcore_daemon.engine.speculative import MIN_DRAFT, DraftSettings, aligned_lengths

# With other requests in the step, drafts may make it at most this many times as long: the
# step is each one's token time (docs/performance/speculative.md, "Sharing the step").
_SHARED_STEP = 2.0
# And none where a prompt is read to its end in the step: that request's first token waits
# for the whole step (docs/performance/speculative.md, "Sharing the step").
_FIRST_TOKEN_STEP = 1.0
# Forced text or a value's copy of the prompt is taken whole; beside judged n-gram drafts
# each of its tokens counts as this likely (docs/performance/forced-drafts.md).
_FORCED_ACCEPTANCE = 0.9


class DraftPlan:
    """The drafts proposed for one step, until `settle` gives them their lengths."""

    __slots__ = ("_settings", "_drafting", "_lengths", "_spare", "rows", "_costs")

    def __init__(self, settings: DraftSettings, draft_rows: int, stepping: list[Seq],
                 costs: StepCosts | None = None, *, shared: bool = False,
                 first_token: bool = False) -> None:
        """The step's `draft_rows` shared evenly among the `stepping` sequences; with
        `costs` (the measured step costs), each n-gram draft cut to the length
        that pays most for the step, none when none pays (draftgate.py). `shared`:
        other requests are in the step; `first_token`: one of them may get its first
        token from it."""
        self._settings = settings
        self._costs = costs
        spare = draft_rows  # draft rows left in this step
        sharing = len(stepping)  # sequences still to get a share of them
        self._drafting: list[tuple[Seq, Proposal]] = []
        self._lengths: list[int] = []
        for seq in stepping:
            share = spare // sharing
            sharing -= 1
            if seq.drafter is None or share < MIN_DRAFT:
                continue
            # Never past max_tokens (the last token sampled is never decoded): drafts stay in
            # the job's KV reservation. It may pass the share by what aligning could add.
            room = min(seq.limit - seq.n_out - 1, share + settings.row_multiple - 1)
            proposal = _propose(seq, room)
            length = min(proposal.length, share)
            # A one-token draft never pays (speculative.MIN_DRAFT), also where a
            # document's check cut a longer one down to it.
            if length >= MIN_DRAFT:
                self._drafting.append((seq, proposal))
                self._lengths.append(length)
                spare -= length
        if costs is not None and self._drafting:
            limit = (_FIRST_TOKEN_STEP if first_token else _SHARED_STEP) if shared else None
            spare += self._judge(costs, len(stepping), limit)
        self._spare = spare
        self.rows = sum(self._lengths)  # the draft rows proposed

    def _judge(self, costs: StepCosts, rows: int, limit: float | None) -> int:
        """Cut each n-gram draft to the length that gives the step the most tokens per
        second by the measured costs, the likeliest first, and drop those cut to none;
        the draft rows this frees. Shared with other requests, the step is each one's
        token time, and the wait of one that arrives meanwhile: its drafts may make it
        at most `limit` times as long as without them."""
        budget = limit * costs.cost(rows) if limit is not None else float("inf")
        tokens = float(rows)
        judged: list[tuple[float, int]] = []
        for index, (seq, proposal) in enumerate(self._drafting):
            if _judged(proposal):
                judged.append((_acceptance(seq, proposal), index))
            else:
                rows += self._lengths[index]
                tokens += expected_tokens(_FORCED_ACCEPTANCE, self._lengths[index])
        judged.sort(reverse=True)
        lengths = self._lengths
        freed = 0
        for p, index in judged:
            length = lengths[index]
            longest = length
            while longest and costs.cost(rows + longest) > budget:
                longest -= 1
            kept, gain = best_length(costs, rows, tokens, p, longest=longest,
                                     shortest=MIN_DRAFT, multiple=self._settings.row_multiple)
            lengths[index] = kept
            freed += length - kept
            rows += kept
            tokens += gain
        if freed:
            kept_drafts = [(draft, length) for draft, length
                           in zip(self._drafting, lengths, strict=True) if length]
            self._drafting = [draft for draft, _ in kept_drafts]
            self._lengths = [length for _, length in kept_drafts]
        return freed

    def settle(self, rows: int, room: int) -> None:
        """Each drafting sequence's `draft`, its length rounded so that the step's logit
        rows come to a multiple of row_multiple (speculative.aligned_lengths). `rows`:
        the step's other logit rows (pending tokens, finished prompts); `room`: the
        batch rows the step leaves free."""
        if not self._drafting:
            return
        lengths = aligned_lengths(rows, self._lengths,
                                  [len(proposal.tokens) for _, proposal in self._drafting],
                                  self._settings.row_multiple, min(self._spare, room))
        costs = self._costs
        if costs is not None and lengths is not self._lengths:
            # Rounded only where the measured costs say it pays: rows come in fours on
            # the default model's output kernel, not on every model's.
            chances = [_acceptance(seq, proposal) for seq, proposal in self._drafting]
            if _rate(costs, rows, chances, lengths) < _rate(costs, rows, chances, self._lengths):
                lengths = self._lengths
        for (seq, proposal), length in zip(self._drafting, lengths, strict=True):
            if length:
                seq.draft = proposal.tokens[:length]
                parts = proposal.parts
                copied = min(parts.copied, length)
                forced = min(parts.forced, length - copied)
                rest = length - copied - forced
                seq.draft_parts = DraftParts(forced, min(parts.guessed, rest), copied,
                                             min(parts.after, rest))


def _judged(proposal: Proposal) -> bool:
    """Whether the gate may cut it: an n-gram draft (not text a grammar forces, nor a
    string value's copy of the prompt)."""
    return proposal.parts.guessed == len(proposal.tokens)


def _acceptance(seq: Seq, proposal: Proposal) -> float:
    if not _judged(proposal):
        return _FORCED_ACCEPTANCE
    assert seq.drafter is not None
    return seq.drafter.acceptance()


def _rate(costs: StepCosts, rows: int, chances: list[float], lengths: list[int]) -> float:
    """Expected tokens per ns of a step of `rows` other logit rows and these drafts."""
    tokens = rows + sum(expected_tokens(p, k) for p, k in zip(chances, lengths, strict=True))
    return tokens / costs.cost(rows + sum(lengths))


class Proposal(NamedTuple):
    """What one sequence may draft this step."""

    tokens: list[int]  # the draft as proposed and what may pad it (settle)
    length: int  # how many of `tokens` to draft, before rounding
    parts: DraftParts  # where they came from


def _propose(seq: Seq, room: int) -> Proposal:
    """`seq`'s draft: the n-gram drafter's; for a `json_schema` document, the text its
    grammar forces first, else its copy of the prompt inside a string value, and the
    drafts cut where the document would refuse them."""
    drafter, forced_drafts, job = seq.drafter, seq.forced, seq.job
    assert drafter is not None and job is not None
    continuation, length = drafter.propose(room)
    grammar = job.grammar
    if forced_drafts is None or grammar is None or not job.grammar_live:
        return Proposal(continuation, length, DraftParts(guessed=len(continuation)))
    emitted = grammar.emitted
    forced = grammar.planned(room) or forced_drafts.propose(emitted, room)
    forcing = len(forced)
    if forcing >= MIN_DRAFT:
        proposal = _then_guess(seq, forced, DraftParts(forced=forcing), room)
        # Unless the drafter's draft agrees with the forced text and the guess and goes
        # further (a copy): where they differ, only the guess read the forced text.
        guess = proposal.tokens[forcing:forcing + proposal.parts.after]
        if length > proposal.length and continuation[:forcing + len(guess)] == forced + guess:
            continuation = continuation[:forced_drafts.fitting(emitted, continuation,
                                                               forced_drafts.values)]
            length = min(length, len(continuation))
            if length > proposal.length:
                return Proposal(continuation, length,
                                DraftParts(forcing, len(continuation) - forcing))
        return proposal
    # Inside a string value: the rest of the prompt text it copies (copying.py) and what
    # closes it; it knows where a phrase ends, which the n-grams' copy of the prose does not.
    copy, closing = forced_drafts.copy(emitted, room)
    if closing and len(copy) + len(closing) >= MIN_DRAFT:
        return _then_guess(seq, copy + closing,
                           DraftParts(forced=len(closing), copied=len(copy)), room)
    if len(copy) >= MIN_DRAFT:
        return Proposal(copy, len(copy), DraftParts(copied=len(copy)))
    continuation = continuation[:forced_drafts.fitting(emitted, continuation,
                                                       forced_drafts.values)]
    length = min(length, len(continuation))
    # Inside a string value, a guess that runs on past the end of a phrase (`2026-07-10;
    # Tom will fix`) closes the value there, as a copy does (copying.py).
    closed = forced_drafts.closed(emitted, continuation[:length], room)
    if closed is not None:
        kept, closing = closed
        return Proposal(kept + closing, len(kept) + len(closing),
                        DraftParts(guessed=len(kept) + len(closing)))
    # A guess that closes the value goes on through what the grammar forces after it
    # (`", "role": "`), which the drafter's own continuation may not hold.
    tail = forced_drafts.after(emitted, continuation[:length], room - length)
    if tail:
        return Proposal(continuation[:length] + tail, length + len(tail),
                        DraftParts(guessed=length + len(tail)))
    return Proposal(continuation, length, DraftParts(guessed=len(continuation)))


def _then_guess(seq: Seq, head: list[int], parts: DraftParts, room: int) -> Proposal:
    """`head` (text the grammar forces, maybe after a copy), then the drafter's guess of
    what follows it (a value from an earlier document; such guesses adapt apart from the
    drafter's own drafts, forced.py's `guessing`) up to the next value's start, then a
    filler that only rounds the step's rows up (settle): a rejected filler row costs its
    compute only, its draw is the token the step would draw anyway."""
    drafter, forced_drafts, job = seq.drafter, seq.forced, seq.job
    assert drafter is not None and forced_drafts is not None and job is not None
    assert job.grammar is not None
    emitted, heading = job.grammar.emitted, len(head)
    guess, extra = drafter.propose_after(head, room - heading, forced_drafts.guessing)
    if guess:
        guess = guess[:max(forced_drafts.fitting(emitted, head + guess,
                                                  forced_drafts.values) - heading, 0)]
        extra = min(extra, len(guess))
    filler = head[-1:] * (room - heading - len(guess))
    return Proposal(head + guess + filler, heading + extra, parts._replace(after=len(guess)))


def verified(seq: Seq, drafted: int, accepted: int) -> None:
    """`accepted` of the `drafted` tokens of `seq`'s draft were kept: its job's counts,
    and each source of the draft adapts to its own part (the n-gram drafter not to the
    forced tokens, nor to rows that only filled the step)."""
    job, drafter = seq.job, seq.drafter
    assert job is not None and drafter is not None
    forced, guessed, copied, after = seq.draft_parts
    seq.draft_parts = NO_PARTS
    copies = min(accepted, copied)
    forces = min(accepted - copies, forced)
    rest = accepted - copies - forces
    job.drafted += drafted
    job.accepted += accepted
    job.forced_drafted += forced
    job.forced_accepted += forces
    if guessed and forces == forced:
        drafter.verified(guessed, min(rest, guessed))
    if seq.forced is not None:
        seq.forced.verified((forced, forces), (copied, copies),
                            (after, min(rest, after)) if forces == forced else (0, 0),
                            whole=accepted == drafted)


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
