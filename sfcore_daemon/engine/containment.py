"""What the step loop does about a failure while it serves one sequence: it stays with
that sequence. On the decode thread; nothing here logs (the failures ride on the job's
end record, and the event loop logs them as the request ends).

- The prompt store (`ContainedStates`): a state that could not be taken is not
  stored; a restore that failed leaves the prompt to be evaluated. The request goes on.
- Ending a job (`drop_after`, around steploop.Ending): the slot is let go and the event
  loop told, whatever fails on the way; a failure while freeing what the job held drops
  the slot's cells.

The drafter contains its own failures (speculative.NgramDrafter), and a failure in a
draw (a sampler, a grammar, its JSON closer) ends that request alone (rows.Rows.fail).
"""

from __future__ import annotations

from collections.abc import Callable

from sfcore_daemon.engine import faults
from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.sequence import Seq
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


def drop_after(exc: Exception, seq: Seq, job: Job, cells: KVCache,
               states: PromptStates) -> None:
    """A failure while ending `seq`'s job (steploop.Ending): it rides on the job's end
    record; what the job still holds is freed, each part tried, and the slot's cells
    are forgotten (nothing in them is trusted then)."""
    job.contained.append(("ending the request", exc))
    sampler, seq.sampler = seq.sampler, None
    steps: list[Callable[[Seq], None]] = [cells.forget, states.unprotect]
    if sampler is not None:
        steps.append(lambda _seq: C.llama_sampler_free(sampler))
    if job.grammar is not None:
        grammar = job.grammar
        steps.append(lambda _seq: grammar.free())
    for step in steps:
        try:
            step(seq)
        except Exception as also:  # each is tried
            job.contained.append(("ending the request", also))
