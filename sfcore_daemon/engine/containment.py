"""What the step loop does about a failure while it serves one sequence: it stays with
that sequence. On the decode thread; nothing here logs (the failures ride on the job,
and the event loop logs them as the request ends).

- The prompt store (`ContainedStates`): a state that could not be taken is not
  stored; a restore that failed leaves the prompt to be evaluated. The request goes on.
- Ending a job (`Ender`): the slot is let go and the event loop told, whatever fails
  on the way; a failure while freeing what the job held drops the slot's cells.

The drafter contains its own failures (speculative.NgramDrafter), and a failure in a
draw (a sampler, a grammar, its JSON closer) ends that request alone (rows.Rows.fail).
"""

from __future__ import annotations

from collections.abc import Callable

from sfcore_daemon.engine import faults
from sfcore_daemon.engine.job import EndReason, Job
from sfcore_daemon.engine.sequence import NO_PARTS, Seq
from sfcore_daemon.engine.storepolicy import PromptStates
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.kvcache import KVCache


class ContainedStates(PromptStates):
    """PromptStates whose failures (a MemoryError copying one state, say) cost the
    sequence they served its restore or its stored state, and nothing else."""

    def restore(self, seq: Seq, job: Job) -> None:
        try:
            super().restore(seq, job)
            if job.cache_source == "ram" or seq.loading is not None:
                faults.hit("restore", job)
        except Exception as exc:  # the store is an optimisation
            self._evaluate_instead(seq, job, exc)

    def loaded(self, seq: Seq) -> None:
        job = seq.job
        assert job is not None
        try:
            super().loaded(seq)
        except Exception as exc:  # the store is an optimisation
            self._evaluate_instead(seq, job, exc)
            self.protect(seq, job)

    def keep(self, seq: Seq, n: int, *, exact: bool = False) -> None:
        try:
            faults.hit("keep", seq.job)
            super().keep(seq, n, exact=exact)
        except Exception as exc:  # not stored, and that is all
            self._failed(seq.job, "keeping a prompt state", exc)

    def keep_prompt(self, seq: Seq, job: Job) -> None:
        try:
            super().keep_prompt(seq, job)
        except Exception as exc:  # not stored, and that is all
            self._failed(job, "keeping a prompt's states", exc)

    def cuts(self, prompt: list[int]) -> list[int]:
        try:
            return super().cuts(prompt)
        except Exception as exc:  # read in n_batch chunks instead
            self._failed(None, "finding a prompt's cuts", exc)
            return []

    def _evaluate_instead(self, seq: Seq, job: Job, exc: Exception) -> None:
        """Whatever the restore left in the slot goes; the prompt is evaluated whole."""
        self._failed(job, "restoring a prompt state", exc)
        seq.loading = None
        self._cells.forget(seq)
        job.n_cached, job.cache_source = 0, "none"
        seq.next_prompt = 0

    def _failed(self, job: Job | None, what: str, exc: Exception) -> None:
        self._count_error()
        if job is not None:
            job.contained.append((what, exc))


class Ender:
    """Ends the job of a sequence: frees what it held, keeps its prompt's states and
    its text for later drafts, lets the slot go and tells the event loop."""

    def __init__(self, cells: KVCache, states: PromptStates, active: list[Seq]) -> None:
        self._cells = cells
        self._states = states
        self._active = active  # the step loop's own list

    def end(self, seq: Seq, reason: EndReason) -> None:
        """End `seq`'s job with `reason`. A failure on the way drops the slot's cells
        (nothing in them is trusted then) and rides on the job to the log; the job
        still ends with `reason`, since what it emitted is whole."""
        job = seq.job
        assert job is not None
        job.end_reason = reason
        try:
            self._release(seq, job, reason)
        except Exception as exc:  # see the docstring
            job.contained.append(("ending the request", exc))
            self._drop(seq, job)
        finally:
            seq.loading = None
            seq.drafter = None
            seq.forced = None
            seq.draft = []
            seq.draft_parts = NO_PARTS
            seq.job = None
            self._active.remove(seq)
            job.loop.call_soon_threadsafe(job._finished)

    def _release(self, seq: Seq, job: Job, reason: EndReason) -> None:
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
        job.kept = list(seq.cached)
        drafter = seq.drafter
        if drafter is not None:
            if reason != "error":
                drafter.learn()
            if drafter.failure is not None:
                job.contained.append(("the drafter", drafter.failure))
        if seq.forced is not None and seq.forced.failure is not None:
            job.contained.append(("the forced drafts", seq.forced.failure))

    def _drop(self, seq: Seq, job: Job) -> None:
        """After a failure in _release: free what is left, forget the cells."""
        job.kept = []
        sampler, seq.sampler = seq.sampler, None
        steps: list[Callable[[Seq], None]] = [self._cells.forget, self._states.unprotect]
        if sampler is not None:
            steps.append(lambda _seq: C.llama_sampler_free(sampler))
        if job.grammar is not None:
            grammar = job.grammar
            steps.append(lambda _seq: grammar.free())
        for step in steps:
            try:
                step(seq)
            except Exception as exc:  # each is tried
                job.contained.append(("ending the request", exc))
