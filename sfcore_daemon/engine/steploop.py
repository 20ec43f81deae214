"""The step loop, on the decode thread: one `llama_decode` per step for every active
sequence, then each output row sampled by its sequence's own chain.

No logits reach Python: per-token Python work is a few C calls, independent of the
vocabulary size. The loop only evaluates prompts, decodes and samples. It hands each
token's bytes to the event loop through its job's `Channel` (crossing.py) and wakes the
loop at most once per step; it never logs, encodes JSON or touches a socket.

A step: the sequences whose wide grammar pass or state read came back rejoin, cancelled
jobs end; `StepBatch.fill` (stepbatch.py) writes the step's rows; one `llama_decode`;
`StepBatch.decoded` moves the rows into each sequence's cache; `Rows.read` (rows.py)
draws each logit row's token, verifies drafts, hands tokens over and wakes the loop.
A job's end, whatever ends it, is `Ending.end`: what it held freed, the slot let go,
its `JobEnd` sent (a failure on the way: containment.py).
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from sfcore_daemon.engine import faults
from sfcore_daemon.engine.containment import ContainedStates, drop_after
from sfcore_daemon.engine.costdrift import CostDrift
from sfcore_daemon.engine.crossing import Channel, EndReason, JobSpec, Placement
from sfcore_daemon.engine.draftgate import AcceptanceBook, StepCosts
from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.prefillshare import PrefillShare
from sfcore_daemon.engine.rows import Rows
from sfcore_daemon.engine.sequence import NO_PARTS, Seq
from sfcore_daemon.engine.speculative import DraftSettings, NgramStore
from sfcore_daemon.engine.stepbatch import StepBatch
from sfcore_daemon.engine.storepolicy import PromptStates, PromptStore
from sfcore_daemon.engine.threadpolicy import ThreadPolicy
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.kvcache import KVCache
from sfcore_daemon.llama.model import Model
from sfcore_daemon.structured.forced import ForcedDrafts

# llama_decode's return value when the abort callback said stop.
_DECODE_ABORTED = 2
# Prompt tokens in one step from which the step can be aborted (about 0.25 s of work).
_ABORTABLE_PREFILL = 128
# When every active sequence waits for a wide grammar pass: how long to wait for one
# before looking at the inbox again.
_PARKED_WAIT_S = 0.005

# What the engine's inbox carries: a job as submitted, or None (stop).
Submitted = tuple[JobSpec, Placement, Channel]


class StepLoop:
    """`slots` sequences of one context, stepped together until the inbox says stop."""

    def __init__(self, model: Model, slots: int, prefill_per_step: int,  # noqa: PLR0917
                 drafts: DraftSettings | None = None,
                 store: PromptStore | None = None,
                 threads: ThreadPolicy | None = None) -> None:
        self.model = model
        # Fewer threads while other processes hold the cores: decided from each
        # decode step's time, applied between steps (threadpolicy.py).
        self._threads = threads
        # Bumped on every step and abort-callback tick (see Engine.progress).
        self.progress = 0
        # Decodes and the rows they held: plain ints the event loop reads (Engine.step_counts).
        self.decode_steps = 0
        self.step_tokens = 0
        self.preempted_steps = 0  # prompt-only steps stopped for a newer job
        # Live steps against the step costs, read on the event loop (costdrift.py).
        self.cost_drift = CostDrift()
        self._ctx = model.ctx
        self.n_ctx = model.n_ctx
        self._drafts = drafts
        # What finished requests generated, for drafts of later ones (any slot).
        self._learned = (NgramStore(self._drafts.ngram_max, self._drafts.store_tokens)
                         if self._drafts is not None and self._drafts.store_tokens else None)
        # How drafts fared lately, for the draft gate's chances (draftgate.py).
        self._book = AcceptanceBook()
        self._seqs = [Seq(seq_id) for seq_id in range(slots)]
        n_swa = C.llama_model_n_swa(model.model)
        self._cells = KVCache(model.memory, self._seqs, model.ctx, n_swa,
                              slots if store is not None else None)
        # A failure in the store or in ending a job stays with its sequence.
        self._states = ContainedStates(store, self._cells, model, n_swa, self._seqs)
        self._active: list[Seq] = []  # sequences with a job, in the order they began
        self._ending = Ending(self._cells, self._states, self._active)
        self._steps = StepBatch(model, slots, prefill_per_step, self._drafts)
        self._rows = Rows(model, self._ending.end)
        # The channels of the prompt batch being decoded, for the abort callback.
        self._abort_jobs: list[Channel] = []
        # Interactive jobs submitted, and those with a short prompt: plain ints the event
        # loop bumps (`submitted`), read by the abort callback.
        self.interactive_submits = 0
        self.short_submits = 0
        # While a prompt-only step is decoded: the counts it yields to once they change
        # (-1: none), and whether it did.
        self._yield_to = (-1, -1)
        self._preempted = False
        self._abort_callback = C.ggml_abort_callback(self._should_abort)
        self._no_abort_callback = C.ggml_abort_callback()

    @property
    def step_costs(self) -> StepCosts | None:
        return self._steps.costs

    def use_step_costs(self, measured: dict[int, float]) -> None:
        """Judge drafts by these step costs (rows -> ns; draftgate.py), before serving."""
        self._steps.costs = StepCosts(measured, self._steps.most_rows)

    def use_prefill_share(self, share: PrefillShare) -> None:
        """Size prompt rows a step by `share` (prefillshare.py), before serving."""
        self._steps.share = share

    def submitted(self, spec: JobSpec) -> None:
        """A job was put in the inbox (event loop): an interactive one may stop a step
        that only reads prompts (`_should_abort`)."""
        if spec.priority != "background":
            # A prompt of one physical batch stops a step that only reads prompts (its
            # whole ubatches are kept): its first token is near.
            if len(spec.prompt) <= self.model.n_ubatch:
                self.short_submits += 1
            self.interactive_submits += 1

    def free(self) -> None:
        """Free the batch; only once the loop has returned."""
        self._rows.shutdown()
        self._steps.free()

    def run(self, inbox: queue.SimpleQueue[Submitted | None]) -> None:
        """Serve jobs from `inbox` until it yields None."""
        active = self._active
        while True:
            if not active:
                submitted = self._states.wait_for_work(inbox)  # idle: sleep until work comes
                if submitted is None:
                    self._states.keep_all()
                    return
                self._begin(*submitted)
            # Whatever arrived meanwhile joins this very step.
            while True:
                try:
                    submitted = inbox.get_nowait()
                except queue.Empty:
                    break
                if submitted is None:
                    for seq in list(active):
                        self._rows.unpark(seq)
                        self._end(seq, "cancelled")
                    self._states.keep_all()
                    return
                self._begin(*submitted)
            if not active:
                continue
            try:
                self._step()
            except BaseException as exc:  # the slots must survive anything; the loop logs it
                # A failure of the step itself (not one sequence's): every job in it
                # ends. Should ending them fail too, the thread ends and Engine says so.
                for seq in list(active):
                    self._rows.fail(seq, exc)

    def _begin(self, spec: JobSpec, placement: Placement, out: Channel) -> None:
        """Put a new job on its slot: drop what the scheduler evicted, reuse the slot's
        cached prefix, build its sampler. Any failure ends the job, never the thread."""
        job = Job(spec, out)
        if faults.DECODE_HANG:
            while True:  # a stuck decode thread, for the watchdog's tests
                time.sleep(3600)
        faults.hit("decode_thread", job)  # the thread dies, for the tests of that
        job.t_start = time.perf_counter_ns()
        seq = self._seqs[placement.slot]
        try:
            for slot in placement.evict:
                self._states.keep(self._seqs[slot], len(self._seqs[slot].cached))
                self._cells.forget(self._seqs[slot])
            self._states.before_reuse(seq, spec.prompt)
            n_reused = self._cells.reuse_prefix(seq, spec.prompt) if spec.cache_prompt else 0
            if n_reused == 0:
                self._cells.forget(seq)
                if not self._active:
                    # Alone on an empty cache (the scheduler emptied it for a request
                    # that reuses nothing): a fresh context's layout, whatever ran before.
                    self._cells.clear_if_empty()
            job.n_cached = n_reused
            job.cache_source = "slot" if n_reused else "none"
            seq.keep_state = spec.cache_prompt
            seq.keep_prefix = 0
            seq.prompt_kept = False
            seq.loading = None
            seq.cuts = self._states.cuts(spec.prompt)
            if spec.cache_prompt and self._states.enabled:
                self._states.restore(seq, job)
            seq.next_prompt = job.n_cached
            if seq.loading is None:
                self._states.protect(seq, job)
            seq.n_out = 0
            seq.generating = False
            seq.limit = min(spec.max_tokens, self.n_ctx - len(spec.prompt))
            self._rows.prepare(seq, job)
            # A seeded request drafts from its own text, by the fixed prior: the store and
            # the book are other requests' history, and its bytes must not depend on them.
            unseeded = spec.sampling.seed is None or spec.sampling.drawn_seed
            learned = self._learned if unseeded else None
            seq.drafter = (faults.drafter(job)(self._drafts, spec.prompt, learned,
                                               self._book if unseeded else None)
                           if spec.speculative and self._drafts is not None else None)
            if seq.drafter is not None:
                seq.drafter.sampled = spec.sampling.temperature > 0
            seq.draft = []
            shape = spec.grammar.shape if spec.grammar is not None else None
            seq.forced = (ForcedDrafts(shape, self.model, spec.prompt) if seq.drafter is not None
                          and shape is not None and self._drafts is not None
                          and self._drafts.forced else None)
        except BaseException as exc:
            job.error = exc
            seq.job = job
            self._active.append(seq)
            self._end(seq, "error")
            return
        seq.job = job
        self._active.append(seq)

    def _step(self) -> None:
        active, rows = self._active, self._rows
        woken: list[Channel] = []
        for seq in list(active):
            parked = seq.parked
            if parked is not None and parked.done():
                seq.parked = None
                try:
                    token = parked.result()
                except Exception as exc:  # one request's failure ends that request alone
                    rows.fail(seq, exc)
                    continue
                rows.take(seq, token, woken)
            if seq.loading is not None:
                self._states.poll(seq)
        for seq in list(active):
            assert seq.job is not None
            # A parked sequence ends once its pass returns: the pass uses its samplers.
            if seq.job.out.stopped and seq.parked is None:
                self._end(seq, "cancelled")
        rows.wake(woken)
        woken = []
        if not active:
            return
        steps = self._steps
        # Before the fill: a job submitted while the step is planned stops it at once.
        submits = (self.short_submits, self.interactive_submits)
        n = steps.fill(active)
        if n == 0:  # every sequence waits: for a grammar pass, a state read or a new job
            waits: list[Future[Any]] = [seq.parked for seq in active
                                        if seq.parked is not None]
            waits += [seq.loading[2] for seq in active if seq.loading is not None]
            wait(waits, _PARKED_WAIT_S, FIRST_COMPLETED)
            self.progress += 1
            return

        ctx, batch, outputs = self._ctx, steps.batch, steps.outputs
        if n - len(outputs) >= _ABORTABLE_PREFILL:
            # The abort callback stops a long prompt batch once all its jobs are cancelled;
            # only here, as llama.cpp calls it (Python, under the GIL) at every graph node.
            self._abort_jobs = [seq.job.out for seq in active if seq.job is not None]
            self._preempted = False
            if not steps.stepping:
                # Only prompts: a short interactive job stops it, and any interactive job
                # stops one that reads only background prompts.
                background = all(seq.job is not None and seq.job.spec.priority == "background"
                                 for seq in steps.prefilling)
                self._yield_to = (submits[0], submits[1] if background else -1)
            started = time.perf_counter_ns()
            C.llama_set_abort_callback(ctx, self._abort_callback, None)
            try:
                rc = C.llama_decode(ctx, batch)
            finally:
                C.llama_set_abort_callback(ctx, self._no_abort_callback, None)
                self._abort_jobs = []
                self._yield_to = (-1, -1)
        else:
            started = time.perf_counter_ns()
            rc = C.llama_decode(ctx, batch)
        self.progress += 1
        if rc == _DECODE_ABORTED and self._preempted:
            self.preempted_steps += 1
            self._keep_read_ubatches()
            return
        if rc == _DECODE_ABORTED:
            # Whole ubatches done before the abort stay in the cache; drop them so
            # each sequence's cache holds exactly its `cached` tokens.
            for seq in list(active):
                rows.unpark(seq)
                self._cells.trim(seq)
                self._end(seq, "cancelled")
            return
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (code {rc}, {n} tokens)")
        self.decode_steps += 1
        self.step_tokens += n

        now = steps.decoded(self._cells)
        rows.read(outputs, woken)
        rows.wake(woken)
        threads = self._threads
        costs = steps.costs
        if (costs is not None and not steps.prefilling and len(steps.stepping) == 1
                and (threads is None or threads.threads == threads.limits.full)):
            # The shape the costs were measured in: are they still this machine's?
            self.cost_drift.observe(n, now - started, costs.cost(n))
        if threads is not None and not steps.prefilling:
            # Each step as a one-row step's time: a step of drafts is a wide one, not one
            # stretched by load (docs/performance/sharing-the-machine.md).
            elapsed = now - started if costs is None else costs.as_one_row(now - started, n)
            if threads.step(elapsed, now):
                # Between two steps: the next graph runs with the new team size.
                C.llama_set_n_threads(ctx, threads.threads, threads.threads_batch)
        if self._states.enabled:
            # The states of prompts read whole this step, while their cells are the prompt:
            # in a sliding-window cache later tokens overwrite rows such a state needs.
            for seq in steps.prefilling:
                if seq.job is not None and seq.job.t_prompt_done == now:
                    self._states.keep_prompt(seq, seq.job)

    def _end(self, seq: Seq, reason: EndReason) -> None:
        self._ending.end(seq, reason)

    def _keep_read_ubatches(self) -> None:
        """The prompt-only step stopped for a newer job: each prompt keeps what the whole
        ubatches before the stop read, and reads on from there in later steps. A prompt's
        last token is read again: its logits did not survive the stop."""
        steps = self._steps
        for seq in steps.prefilling:
            job = seq.job
            assert job is not None
            held = min(self._cells.held(seq), seq.chunk_end, len(job.spec.prompt) - 1)
            seq.chunk_end = max(held, seq.next_prompt)
        steps.decoded(self._cells)
        for seq in steps.prefilling:
            self._cells.trim(seq)

    def _should_abort(self, _data: Any) -> bool:
        self.progress += 1
        jobs = self._abort_jobs
        if jobs and all(out.stopped for out in jobs):
            return True
        short, interactive = self._yield_to
        if (short >= 0 and self.short_submits != short) or (
                interactive >= 0 and self.interactive_submits != interactive):
            self._preempted = True
            return True
        return False


class Ending:
    """The end of a job, whatever ends it: frees what it held, keeps its prompt's
    states and its text for later drafts, lets the slot go and sends its `JobEnd` (the
    job's last word on the crossing). A failure on the way is containment.py's."""

    def __init__(self, cells: KVCache, states: PromptStates, active: list[Seq]) -> None:
        self._cells = cells
        self._states = states
        self._active = active  # the step loop's own list

    def end(self, seq: Seq, reason: EndReason) -> None:
        """End `seq`'s job with `reason`. A failure on the way drops the slot's cells
        (drop_after) and rides on the end record to the log; the job still ends with
        `reason`, since what it emitted is whole."""
        job = seq.job
        assert job is not None
        kept: list[int] = []
        try:
            kept = self._release(seq, job, reason)
        except Exception as exc:  # see the docstring
            drop_after(exc, seq, job, self._cells, self._states)
        finally:
            seq.loading = None
            seq.drafter = None
            seq.forced = None
            seq.draft = []
            seq.draft_parts = NO_PARTS
            seq.job = None
            self._active.remove(seq)
            job.out.end(job.ended(reason, kept))

    def _release(self, seq: Seq, job: Job, reason: EndReason) -> list[int]:
        """Free what the job held; the tokens its slot keeps."""
        if reason == "error":
            self._cells.forget(seq)
        sampler, seq.sampler = seq.sampler, None
        if sampler is not None:
            C.llama_sampler_free(sampler)
        if job.grammar is not None:
            job.grammar.free()
        seq.loading = None
        faults.hit("end", job)
        if reason != "error" and not seq.prompt_kept and job.t_prompt_done:
            self._states.keep_prompt(seq, job)  # it ended in the step that read its prompt
        self._states.unprotect(seq)
        self._cells.unplace(seq)
        kept = list(seq.cached)
        drafter = seq.drafter
        if drafter is not None:
            if reason != "error":
                drafter.learn()
            if drafter.failure is not None:
                job.contained.append(("the drafter", drafter.failure))
        if seq.forced is not None and seq.forced.failure is not None:
            job.contained.append(("the forced drafts", seq.forced.failure))
        return kept
