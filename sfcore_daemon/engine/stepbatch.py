"""A step's batch, on the decode thread: which rows go into the step's one `llama_decode`
(each generating sequence's pending token and its draft, then prompt chunks), which
rows ask for logits, and what the sequences hold once the batch is decoded.
"""

from __future__ import annotations

import time
from typing import Any

from sfcore_daemon.engine.draftgate import StepCosts
from sfcore_daemon.engine.drafting import DraftPlan, count_aligned, logit_rows
from sfcore_daemon.engine.prefillshare import PrefillShare
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.engine.speculative import DraftSettings
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.kvcache import KVCache
from sfcore_daemon.llama.model import Model

# Prompt tokens left up to which a prompt is a short rest (a question after a restored or
# reused prefix, a chat's new turn, a short prompt): read whole, before the long ones.
_SHORT_REST = 64
# Without step costs (not measured by this config, or a context too small to measure them in):
# rows of short rests a step, unless the shortest has more (else PrefillShare.short_rows)...
_UNMEASURED_SHORT_ROWS = 32
# ...and prompt rows a step beside streams with prefill_per_step 0 (else PrefillShare.rows).
_UNMEASURED_PER_STEP = 64


def _rest(seq: Seq) -> int:
    job = seq.job
    assert job is not None
    return len(job.spec.prompt) - seq.next_prompt


def _burst(seq: Seq, streams: list[tuple[int, int]], most: int) -> bool:
    """Whether `seq`'s prompt began while each of `streams` (their jobs' start and first
    token times) was still waiting for its first token, and has at most `most` tokens
    left."""
    job = seq.job
    if job is None or _rest(seq) > most:
        return False
    began = job.t_start
    return all(start <= began < first for start, first in streams)


def _background(seq: Seq) -> bool:
    job = seq.job
    return job is not None and job.spec.priority == "background"


def _reading_order(seq: Seq) -> tuple[bool, bool, int]:
    """Short rests first, interactive before background, the fewest tokens left first;
    then the long prompts, interactive first (the sort is stable: oldest request first
    among equals)."""
    rest = _rest(seq)
    return (rest > _SHORT_REST, _background(seq), rest if rest <= _SHORT_REST else 0)


class StepBatch:
    """The one batch every step is decoded from, sized for n_batch tokens of one sequence
    each, and the plan of the step being decoded: after `fill`, `stepping` (generating
    sequences), `prefilling` (those reading a prompt chunk) and `outputs` (each logit
    row's sequence and row: a pending token's, or a prompt's last)."""

    def __init__(self, model: Model, slots: int, prefill_per_step: int,
                 drafts: DraftSettings | None) -> None:
        batch = model.n_batch
        self._prefill_per_step = prefill_per_step
        self._drafts = drafts
        self._draft_rows = 0 if drafts is None else min(drafts.step_rows, batch - slots)
        # A step's time by its logit rows (draftgate.py), once measured: the drafts are
        # judged by them. None: every draft is taken ([speculative] policy "always").
        self.costs: StepCosts | None = None
        # Prompt rows a step by the measured costs (short rests; beside streams with
        # prefill_per_step 0), else None.
        self.share: PrefillShare | None = None
        self.most_rows = slots + self._draft_rows + (drafts.row_multiple if drafts else 0)
        self._n_batch = batch
        self.batch: Any = C.llama_batch_init(batch, 0, 1)
        for row in range(batch):
            self.batch.n_seq_id[row] = 1
        self.stepping: list[Seq] = []
        self.prefilling: list[Seq] = []
        self.outputs: list[tuple[Seq, int]] = []

    def free(self) -> None:
        """Free the batch; only once the loop has returned."""
        if self.batch is not None:
            C.llama_batch_free(self.batch)
            self.batch = None

    def fill(self, active: list[Seq]) -> int:
        """Plan the step for the `active` sequences and write its rows into the batch;
        the number of rows (0: every sequence waits)."""
        batch = self.batch
        tokens, positions, seq_ids, wants = batch.token, batch.pos, batch.seq_id, batch.logits
        outputs: list[tuple[Seq, int]] = []
        prefilling: list[Seq] = []
        stepping = [seq for seq in active if seq.generating and seq.parked is None]
        self.stepping, self.prefilling, self.outputs = stepping, prefilling, outputs
        reading = [seq for seq in active
                   if not seq.generating and seq.parked is None and seq.loading is None]
        # Generating sequences first (pending token and draft, each row asking for logits);
        # drafts settle once the chunks are planned: a prompt read to its end adds a row.
        depth = sum(len(seq.cached) for seq in stepping) // len(stepping) if stepping else 0
        if self.costs is not None:
            # Each draft row attends over its sequence's context (draftgate.StepCosts).
            self.costs.depth = depth
        # A prompt begun while every interactive stream waited for its first token came with
        # them (a burst): its last n_batch rows are read whole (docs/performance/slots.md).
        streams = [(seq.job.t_start, seq.job.t_first) for seq in stepping
                   if seq.job is not None and not _background(seq)]
        chunk = self._n_batch
        bursting = {seq.id for seq in reading if _burst(seq, streams, chunk)} if streams else ()
        if len(reading) > 1:
            reading.sort(key=_reading_order)
        per_step = self._per_step(len(stepping), depth, reading) if streams else chunk
        plan = (DraftPlan(self._drafts, self._draft_rows, stepping, self.costs,
                          shared=len(active) > 1,
                          first_token=any(_rest(seq) <= per_step
                                          or seq.id in bursting for seq in reading))
                if self._drafts is not None and stepping else None)
        n = len(stepping) + (plan.rows if plan is not None else 0)
        # Then prompts, short rests first, then oldest first; beside interactive streams at
        # most per_step rows, so a long prompt never holds them up (docs/performance/slots.md).
        spare = self._n_batch - n
        budget = min(per_step, spare) if streams else spare
        long_rows = True
        if len(reading) > 1:
            first_rest = _rest(reading[0])
            if first_rest <= _SHORT_REST:
                rows = self._short_rows(len(stepping), depth, reading)
                spare = min(spare, max(rows, first_rest))
                budget = min(budget, spare)
                # A long prompt's rows attend over its context read so far: at depth a few
                # of them cost the step more than the short rest that waits for them.
                long_rows = _background(reading[0])
        # Alone, a prompt is also cut at its cuts (storepolicy.PromptStates.cuts) for the
        # cold run's bytes; beside other rows a cut would only delay its rest by a step.
        alone = n == 0 and len(reading) == 1
        ends = 0  # prompts read to their end in this step
        for seq in reading:
            if spare <= 0 or (not long_rows and _rest(seq) > _SHORT_REST):
                break  # short rests come first
            room = spare if seq.id in bursting else budget
            job = seq.job
            assert job is not None
            prompt, pos = job.spec.prompt, seq.next_prompt
            if room <= 0 or (prefilling and room < len(prompt) - pos <= _SHORT_REST):
                continue  # a short rest is read whole
            end = min(pos - pos % chunk + chunk, len(prompt), pos + room)
            for cut in seq.cuts if alone else ():
                if pos < cut < end:
                    end = cut
                    break
            budget -= end - pos
            spare -= end - pos
            seq.chunk_end = end
            prefilling.append(seq)
            ends += end == len(prompt)
        if plan is not None:
            plan.settle(len(stepping) + ends, self._n_batch - n - sum(
                seq.chunk_end - seq.next_prompt for seq in prefilling))
        n = 0
        for seq in stepping:
            pos, sid = len(seq.cached), seq.id
            tokens[n] = seq.last_token
            positions[n] = pos
            seq_ids[n][0] = sid
            wants[n] = 1
            outputs.append((seq, n))
            n += 1
            for token in seq.draft:
                pos += 1
                tokens[n] = token
                positions[n] = pos
                seq_ids[n][0] = sid
                wants[n] = 1
                n += 1
        for seq in prefilling:
            job = seq.job
            assert job is not None
            prompt, sid = job.spec.prompt, seq.id
            for index in range(seq.next_prompt, seq.chunk_end):
                tokens[n] = prompt[index]
                positions[n] = index
                seq_ids[n][0] = sid
                wants[n] = 0
                n += 1
            if seq.chunk_end == len(prompt):
                wants[n - 1] = 1
                outputs.append((seq, n - 1))
        if plan is not None and plan.rows:
            assert self._drafts is not None
            count_aligned([seq for seq in stepping if seq.draft], logit_rows(batch, n),
                          self._drafts.row_multiple)
        batch.n_tokens = n
        return n

    def _per_step(self, streams: int, depth: int, reading: list[Seq]) -> int:
        """Prompt rows of a step beside `streams` generating sequences (`depth` cells on
        average): prefill_per_step, or with 0 what the measured costs give for the first
        prompt in reading order."""
        if self._prefill_per_step > 0:
            return self._prefill_per_step
        if self.share is None:
            return _UNMEASURED_PER_STEP
        return self.share.rows(streams, depth, reading[0].next_prompt if reading else 0)

    def _short_rows(self, streams: int, depth: int, reading: list[Seq]) -> int:
        """Rows of short rests a step (reading in reading order, a short rest first)."""
        if self.share is None:
            return _UNMEASURED_SHORT_ROWS
        waiting = 0
        for seq in reading:
            rest = _rest(seq)
            if rest > _SHORT_REST:
                break
            waiting += rest
        return self.share.short_rows(streams, depth, reading[0].next_prompt, waiting)

    def decoded(self, cells: KVCache) -> int:
        """The batch was decoded: each sequence's cache holds its rows (a draft's, once
        verified). The time the step's prompts were read (time.perf_counter_ns)."""
        for seq in self.stepping:
            seq.cached.append(seq.last_token)
        now = time.perf_counter_ns()
        for seq in self.prefilling:
            job = seq.job
            assert job is not None
            seq.cached.extend(job.spec.prompt[seq.next_prompt:seq.chunk_end])
            seq.next_prompt = seq.prompt_rows = seq.chunk_end
            if seq.chunk_end == len(job.spec.prompt):
                job.t_prompt_done = now
            elif seq.protect_from >= 0:
                cells.protect(seq, seq.protect_from)
        return now
