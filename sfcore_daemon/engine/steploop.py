"""The step loop, on the decode thread: one `llama_decode` per step for every active
sequence, then each output row sampled by its sequence's own chain.

No logits reach Python: per-token Python work is a few C calls, independent of the
vocabulary size. The loop only evaluates prompts, decodes and samples. It hands each
token's bytes to the event loop through `Job.pieces` and wakes the loop at most once
per step; it never logs, encodes JSON or touches a socket.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from sfcore_daemon.engine import faults
from sfcore_daemon.engine.containment import ContainedStates, Ender
from sfcore_daemon.engine.drafting import DraftPlan, count_aligned, logit_rows
from sfcore_daemon.engine.job import EndReason, Job
from sfcore_daemon.engine.sampling import PENALTY_LAST_N, argmax, is_plain_greedy, make_chain
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.engine.speculative import DraftSettings, NgramStore
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.kvcache import KVCache, shared_prefix
from sfcore_daemon.llama.model import Model
from sfcore_daemon.store.promptstore import PromptStore

# llama_decode's return value when the abort callback said stop.
_DECODE_ABORTED = 2
# Prompt tokens in one step from which the step can be aborted (about 0.25 s of work).
_ABORTABLE_PREFILL = 128
# When every active sequence waits for a wide grammar pass: how long to wait for one
# before looking at the inbox again.
_PARKED_WAIT_S = 0.005
# Prompt tokens left up to which a prompt is a short rest (a question after a restored or
# reused prefix, a chat's new turn, a short prompt): read whole, before the long ones.
_SHORT_REST = 64
# Rows of short rests in one step, unless the shortest alone has more. A step's cost grows
# with its rows (about 4.5 ms a row at 1000 cells of context, over ~15 ms a step), so a
# burst's mean first token is lowest when its shortest prompts go first, one or a few a
# step: 8 restored questions of ~18 tokens in one step all waited ~800 ms for it; one a
# step, their first tokens came at ~100 ms intervals. (docs/performance.md, "Parallel
# slots": the 12-client churn's mean first token 1254 -> 906 ms.)
_SHORT_STEP_ROWS = 32


def _rest(seq: Seq) -> int:
    job = seq.job
    assert job is not None
    return len(job.prompt) - seq.next_prompt


def _reading_order(seq: Seq) -> tuple[bool, int]:
    """Short rests first, the fewest tokens left first; then the long prompts (the
    sort is stable: oldest request first among them)."""
    rest = _rest(seq)
    return (rest > _SHORT_REST, rest if rest <= _SHORT_REST else 0)


def _drain_each(jobs: list[Job]) -> None:
    for job in jobs:
        job._wake()


class StepLoop:
    """`slots` sequences of one context, stepped together until the inbox says stop."""

    def __init__(self, model: Model, slots: int, prefill_per_step: int,  # noqa: PLR0917
                 reproducible: bool, drafts: DraftSettings | None = None,
                 store: PromptStore | None = None) -> None:
        self.model = model
        # Bumped on every step and abort-callback tick (see Engine.progress).
        self.progress = 0
        self._ctx = model.ctx
        self._vocab = model.vocab
        self.n_ctx = model.n_ctx
        self._prefill_per_step = prefill_per_step
        # Verified drafts change float summation order (rows decoded together), so
        # reproducible mode never speculates.
        self._drafts = None if reproducible else drafts
        self._draft_rows = 0 if self._drafts is None else min(
            self._drafts.step_rows, model.n_batch - slots)
        # What finished requests generated, for drafts of later ones (any slot).
        self._learned = (NgramStore(self._drafts.ngram_max, self._drafts.store_tokens)
                         if self._drafts is not None and self._drafts.store_tokens else None)
        self._memory = model.memory
        batch = model.n_batch
        # Reproducible mode cuts prompts at multiples of n_ubatch, so that a chunk
        # evaluated after a cache hit is cut exactly as in a cold run.
        self._prefill_chunk = batch - batch % model.n_ubatch if reproducible else batch
        self._n_batch = batch
        self._n_vocab = model.info.n_vocab
        self._seqs = [Seq(seq_id) for seq_id in range(slots)]
        # Reproducible mode keeps no states: its bytes never depend on the cache.
        store = None if reproducible else store
        n_swa = C.llama_model_n_swa(model.model)
        self._cells = KVCache(model.memory, self._seqs, model.n_ubatch, reproducible,
                              model.ctx, n_swa, slots if store is not None else None)
        # A failure in the store or in ending a job stays with its sequence.
        self._states = ContainedStates(store, self._cells, model, n_swa, self._seqs)
        self._active: list[Seq] = []  # sequences with a job, in the order they began
        self._ender = Ender(self._cells, self._states, self._active)
        # One batch for every step, sized for n_batch tokens of one sequence each.
        self._batch: Any = C.llama_batch_init(batch, 0, 1)
        for row in range(batch):
            self._batch.n_seq_id[row] = 1
        # The jobs of the prompt batch being decoded, for the abort callback.
        self._abort_jobs: list[Job] = []
        self._abort_callback = C.ggml_abort_callback(self._should_abort)
        self._no_abort_callback = C.ggml_abort_callback()
        # Wide grammar passes (grammar.py) take 3 ms to over a second: they run here,
        # beside the steps, instead of inside the step every sequence shares.
        self._wide_passes = ThreadPoolExecutor(1, thread_name_prefix="sfcore-grammar")

    def free(self) -> None:
        """Free the batch; only once the loop has returned."""
        self._wide_passes.shutdown(wait=True)
        if self._batch is not None:
            C.llama_batch_free(self._batch)
            self._batch = None

    def run(self, inbox: queue.SimpleQueue[Job | None]) -> None:
        """Serve jobs from `inbox` until it yields None."""
        active = self._active
        while True:
            if not active:
                job = inbox.get()  # idle: sleep until work comes
                if job is None:
                    self._states.keep_all()
                    return
                self._begin(job)
            # Whatever arrived meanwhile joins this very step.
            while True:
                try:
                    job = inbox.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    for seq in list(active):
                        self._unpark(seq)
                        self._end(seq, "cancelled")
                    self._states.keep_all()
                    return
                self._begin(job)
            if not active:
                continue
            try:
                self._step()
            except BaseException as exc:  # the slots must survive anything; the loop logs it
                # A failure of the step itself (not one sequence's): every job in it
                # ends. Should ending them fail too, the thread ends and Engine says so.
                for seq in list(active):
                    self._fail(seq, exc)

    def _begin(self, job: Job) -> None:
        """Put a new job on its slot: drop what the scheduler evicted, reuse the slot's
        cached prefix, build its sampler. Any failure ends the job, never the thread."""
        if faults.DECODE_HANG:
            while True:  # a stuck decode thread, for the watchdog's tests
                time.sleep(3600)
        faults.hit("decode_thread", job)  # the thread dies, for the tests of that
        job.t_start = time.perf_counter_ns()
        seq = self._seqs[job.slot]
        try:
            for slot in job.evict:
                self._states.keep(self._seqs[slot], len(self._seqs[slot].cached))
                self._cells.forget(self._seqs[slot])
            if shared_prefix(seq.cached, job.prompt) < len(seq.cached):
                self._states.keep(seq, len(seq.cached))  # its cells are about to be overwritten
            n_reused = self._cells.reuse_prefix(seq, job.prompt) if job.cache_prompt else 0
            if n_reused == 0:
                self._cells.forget(seq)
            job.n_cached = n_reused
            job.cache_source = "slot" if n_reused else "none"
            seq.keep_state = job.cache_prompt
            seq.keep_prefix = 0
            seq.prompt_kept = False
            seq.loading = None
            seq.cuts = self._states.cuts(job.prompt)
            if job.cache_prompt and self._states.enabled:
                self._states.restore(seq, job)
            seq.next_prompt = job.n_cached
            if seq.loading is None:
                self._states.protect(seq, job)
            seq.n_out = 0
            seq.generating = False
            seq.limit = min(job.max_tokens, self.n_ctx - len(job.prompt))
            seq.sampler, penalties = make_chain(self._vocab, job.sampling, job.prompt)
            seq.argmax = job.grammar is None and is_plain_greedy(job.sampling)
            if job.grammar is not None:  # it counts its tokens against the same limit
                job.grammar.begin(seq.limit, penalties, PENALTY_LAST_N)
            seq.drafter = (faults.drafter(job)(self._drafts, job.prompt, self._learned)
                           if job.speculative and self._drafts is not None else None)
            seq.draft = []
        except BaseException as exc:
            job.error = exc
            seq.job = job
            self._active.append(seq)
            self._end(seq, "error")
            return
        seq.job = job
        self._active.append(seq)

    def _step(self) -> None:
        active = self._active
        woken: list[Job] = []
        for seq in list(active):
            parked = seq.parked
            if parked is not None and parked.done():
                seq.parked = None
                try:
                    token = parked.result()
                except Exception as exc:  # one request's failure ends that request alone
                    self._fail(seq, exc)
                    continue
                self._take(seq, token, woken)
            if seq.loading is not None:
                self._states.poll(seq)
        for seq in list(active):
            assert seq.job is not None
            # A parked sequence ends once its pass returns: the pass uses its samplers.
            if seq.job.stop_requested and seq.parked is None:
                self._end(seq, "cancelled")
        self._wake(woken)
        woken = []
        if not active:
            return
        batch = self._batch
        tokens, positions, seq_ids, wants = batch.token, batch.pos, batch.seq_id, batch.logits
        outputs: list[tuple[Seq, int]] = []
        prefilling: list[Seq] = []
        stepping = [seq for seq in active if seq.generating and seq.parked is None]
        # Every generating sequence first: its pending token and its draft, if any, each
        # row asking for logits. The drafts are proposed now and settled once the
        # prompt chunks are planned: a prompt read to its end adds a logit row too.
        plan = (DraftPlan(self._drafts, self._draft_rows, stepping)
                if self._drafts is not None and stepping else None)
        n = len(stepping) + (plan.rows if plan is not None else 0)
        # Then prompt tokens: first the short rests (their first token is near), the
        # shortest first, each whole and at most _SHORT_STEP_ROWS rows of them a step;
        # then the others, oldest request first. Alone, a prompt goes in whole n_batch
        # chunks; beside streaming sequences, at most prefill_per_step tokens a step,
        # so their next token is never held up by a whole long prompt.
        budget = self._n_batch - n if n == 0 else min(self._prefill_per_step, self._n_batch - n)
        chunk = self._prefill_chunk
        reading = [seq for seq in active
                   if not seq.generating and seq.parked is None and seq.loading is None]
        if len(reading) > 1:
            reading.sort(key=_reading_order)
            first_rest = _rest(reading[0])
            if first_rest <= _SHORT_REST:
                budget = min(budget, max(_SHORT_STEP_ROWS, first_rest))
        # A prompt read alone is cut at its cuts too (promptstates.PromptStates.cuts):
        # a cold run's bytes come only from a batch of its own. Beside other rows a cut
        # would just delay the rest of the prompt by a step.
        alone = n == 0 and len(reading) == 1
        ends = 0  # prompts read to their end in this step
        for seq in reading:
            if budget <= 0:
                break
            job = seq.job
            assert job is not None
            prompt, pos = job.prompt, seq.next_prompt
            if prefilling and budget < len(prompt) - pos <= _SHORT_REST:
                continue  # a short rest is read whole
            end = min(pos - pos % chunk + chunk, len(prompt), pos + budget)
            for cut in seq.cuts if alone else ():
                if pos < cut < end:
                    end = cut
                    break
            budget -= end - pos
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
            prompt, sid = job.prompt, seq.id
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
        if n == 0:  # every sequence waits: for a grammar pass, a state read or a new job
            waits: list[Future[Any]] = [seq.parked for seq in active
                                        if seq.parked is not None]
            waits += [seq.loading[2] for seq in active if seq.loading is not None]
            wait(waits, _PARKED_WAIT_S, FIRST_COMPLETED)
            self.progress += 1
            return

        ctx = self._ctx
        if n - len(outputs) >= _ABORTABLE_PREFILL:
            # A big prompt batch can take seconds: the abort callback stops it once
            # every sequence in it is cancelled. Installed for those batches only:
            # llama.cpp polls it once per graph node (a Python call holding the GIL),
            # hundreds of times a step, and a small batch ends soon anyway.
            self._abort_jobs = [seq.job for seq in active if seq.job is not None]
            C.llama_set_abort_callback(ctx, self._abort_callback, None)
            try:
                rc = C.llama_decode(ctx, batch)
            finally:
                C.llama_set_abort_callback(ctx, self._no_abort_callback, None)
                self._abort_jobs = []
        else:
            rc = C.llama_decode(ctx, batch)
        self.progress += 1
        if rc == _DECODE_ABORTED:
            # Whole ubatches done before the abort stay in the cache; drop them so
            # each sequence's cache holds exactly its `cached` tokens.
            for seq in list(active):
                self._unpark(seq)
                self._cells.trim(seq)
                self._end(seq, "cancelled")
            return
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (code {rc}, {n} tokens)")

        for seq in stepping:
            seq.cached.append(seq.last_token)
        now = time.perf_counter_ns()
        for seq in prefilling:
            job = seq.job
            assert job is not None
            seq.cached.extend(job.prompt[seq.next_prompt:seq.chunk_end])
            seq.next_prompt = seq.prompt_rows = seq.chunk_end
            if seq.chunk_end == len(job.prompt):
                job.t_prompt_done = now
            elif seq.protect_from >= 0:
                self._cells.protect(seq, seq.protect_from)

        for seq, row in outputs:
            try:
                if seq.draft:
                    self._verify(seq, row, woken)
                    continue
                drawn = self._sample(seq, row)
                if drawn is not None:
                    self._take(seq, drawn, woken)
            except Exception as exc:  # one request's failure ends that request alone
                self._fail(seq, exc)
        self._wake(woken)
        if self._states.enabled:
            # Once the first tokens are on their way: the states of prompts read whole
            # this step, while their cells are the prompt (a sliding-window cache lets
            # later tokens overwrite rows a prefix's state needs).
            for seq in prefilling:
                if seq.job is not None and seq.job.t_prompt_done == now:
                    self._states.keep_prompt(seq, seq.job)

    def _sample(self, seq: Seq, row: int) -> int | None:
        """The sequence's next token from the logits of `row`; None when a wide grammar
        pass will draw it (the sequence is parked) or the job ended with an error."""
        job = seq.job
        assert job is not None
        grammar = job.grammar
        try:
            if seq.argmax:
                return argmax(self._ctx, row, self._n_vocab)
            if grammar is None:
                token: int = C.llama_sampler_sample(seq.sampler, self._ctx, row)
                return token
            if grammar.closer is not None:
                faults.hit("closer", job)  # as if the closer (closer.py) failed, for the tests
            # Checks the chain's choice against the grammar (see grammar.py).
            drawn = grammar.sample(seq.sampler, self._ctx, row)
            if drawn is None:
                seq.parked = self._wide_passes.submit(grammar.sample_wide, seq.sampler)
            return drawn
        except Exception as exc:  # one request's failure ends that request alone
            self._fail(seq, exc)
            return None

    def _verify(self, seq: Seq, row: int, woken: list[Job]) -> None:
        """Sample the rows of the pending token and its draft in order, exactly as one
        token a step would: each draft token is kept while it equals what the chain
        drew from the row before it; the first that differs ends the run, and the
        drawn token is the next one. The rejected tokens' cells are removed."""
        draft, seq.draft = seq.draft, []
        taken: list[int] = []
        accepted = 0
        vocab = self._vocab
        for index in range(len(draft) + 1):
            token = self._sample(seq, row + index)
            if token is None:  # parked after `accepted` tokens, or ended
                break
            taken.append(token)
            if (index == len(draft) or token != draft[index]
                    or C.llama_vocab_is_eog(vocab, token)):
                break
            accepted += 1
        job = seq.job
        if job is None:  # ended with an error: its cells are gone
            return
        seq.cached.extend(draft[:accepted])
        if accepted < len(draft):
            C.llama_memory_seq_rm(self._memory, seq.id, len(seq.cached), -1)
        job.drafted += len(draft)
        job.accepted += accepted
        assert seq.drafter is not None
        seq.drafter.verified(len(draft), accepted)
        for token in taken:
            self._take(seq, token, woken)
            if seq.job is None:
                break

    def _take(self, seq: Seq, token: int, woken: list[Job]) -> None:
        """A sampled token: the end of the job, or a piece of its output and the
        sequence's next input. A failure here ends that request alone."""
        try:
            self._take_token(seq, token, woken)
        except Exception as exc:
            self._fail(seq, exc)

    def _take_token(self, seq: Seq, token: int, woken: list[Job]) -> None:
        job = seq.job
        assert job is not None
        now = time.perf_counter_ns()
        if seq.n_out == 0:
            job.t_first = now
        if C.llama_vocab_is_eog(self._vocab, token):
            self._end(seq, "stop")
            return
        model = self.model
        piece = model.pieces.get(token)
        if piece is None:
            piece = model.piece(token)
        job.pieces.append((piece, now))
        if not job.wake_pending:
            job.wake_pending = True
            woken.append(job)
        seq.n_out += 1
        if seq.drafter is not None:
            seq.drafter.append(token)
        if seq.n_out >= seq.limit:
            # A document its grammar would end here is whole: "stop", not "length".
            grammar = job.grammar
            self._end(seq, "stop" if grammar is not None and grammar.complete() else "length")
            return
        seq.last_token = token
        seq.generating = True

    @staticmethod
    def _wake(woken: list[Job]) -> None:
        if woken:
            # One wake-up of the event loop per step, whatever the number of streams.
            woken[0].loop.call_soon_threadsafe(_drain_each, woken)

    @staticmethod
    def _unpark(seq: Seq) -> None:
        """Wait for the sequence's wide grammar pass (it uses the samplers _end frees)."""
        if seq.parked is not None:
            wait([seq.parked])
            seq.parked = None

    def _end(self, seq: Seq, reason: EndReason) -> None:
        self._ender.end(seq, reason)

    def _fail(self, seq: Seq, exc: BaseException) -> None:
        """End `seq`'s job with the error `exc`, unless it has ended already."""
        job = seq.job
        if job is not None:
            job.error = exc
            self._unpark(seq)
            self._end(seq, "error")

    def _should_abort(self, _data: Any) -> bool:
        self.progress += 1
        jobs = self._abort_jobs
        return bool(jobs) and all(job.stop_requested for job in jobs)
