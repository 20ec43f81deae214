"""A job as the decode thread runs it: the decode thread's alone.

Made by the step loop from what the engine's inbox hands it (the frozen `JobSpec` and
`Placement`, the `Channel` back; crossing.py); what it counts here reaches the event
loop only in the `JobEnd` it sends as the job ends. No module outside engine/ imports
it (tests/repo/test_layout.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sfcore_daemon.engine.crossing import CacheSource, Channel, EndReason, JobEnd, JobSpec

if TYPE_CHECKING:
    from sfcore_daemon.structured.grammar import GrammarSampler


class Job:
    """One generation's progress on the decode thread."""

    __slots__ = (
        "spec", "out", "grammar", "grammar_live", "trigger_tail", "n_cached", "cache_source",
        "restore_failed", "contained", "notices", "error", "t_start", "t_prompt_done",
        "t_first", "drafted", "accepted", "forced_drafted", "forced_accepted", "draft_steps",
        "aligned_steps", "logit_rows", "pinned",
    )

    def __init__(self, spec: JobSpec, out: Channel) -> None:
        self.spec = spec
        self.out = out  # its way back to the event loop
        # The spec's grammar, this thread's from submit on: it frees it as the job ends.
        self.grammar: GrammarSampler | None = spec.grammar
        # With a trigger, the grammar holds the output only once the output ends with
        # it; before, the job samples as without one. The tail of the output watched.
        self.grammar_live = spec.grammar is not None and spec.grammar_trigger is None
        self.trigger_tail = b""
        self.n_cached = 0
        # Where the n_cached rows came from: a slot's cells, or a stored state
        # restored from the RAM or the disk tier (promptstore.py).
        self.cache_source: CacheSource = "none"
        # A stored state llama.cpp refused: the prompt was evaluated (the loop logs it).
        self.restore_failed = False
        # Failures contained while serving this job (the prompt store, the drafter,
        # ending it): each skipped its part and the job went on. (what, the exception).
        self.contained: list[tuple[str, BaseException]] = []
        self.notices: list[str] = []  # what else the loop is to log
        self.error: BaseException | None = None
        self.t_start = 0
        self.t_prompt_done = 0
        self.t_first = 0
        # Speculative decoding (speculative.py), counted from the batch as submitted;
        # forced_*: the tokens of a schema's forced text among them.
        self.drafted = 0
        self.accepted = 0  # of the drafted tokens
        self.forced_drafted = 0
        self.forced_accepted = 0
        self.draft_steps = 0  # steps that verified its drafts
        self.aligned_steps = 0  # of those, the ones whose logit rows were whole multiples
        self.logit_rows = 0  # those steps' logit rows
        self.pinned = 0  # the longest of its cache marks' prefixes it stored

    def ended(self, reason: EndReason, kept: list[int]) -> JobEnd:
        """The end record to send: what this job came to, frozen."""
        grammar = self.grammar
        return JobEnd(
            reason, self.error, self.n_cached, self.cache_source, self.restore_failed,
            self.t_start, self.t_prompt_done, self.t_first, self.drafted, self.accepted,
            self.forced_drafted, self.forced_accepted, self.draft_steps, self.aligned_steps,
            self.logit_rows,
            grammar.tokens if grammar is not None else 0,
            grammar.resampled if grammar is not None else 0,
            grammar is not None and grammar.closed_early,
            kept, tuple(self.contained), tuple(self.notices), pinned=self.pinned)
