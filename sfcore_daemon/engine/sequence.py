"""One slot's sequence: its KV cells (kvcache.SeqCells) and what the step loop and the
prompt store's side of it (storepolicy.py) keep for the job it runs."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, NamedTuple

from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.speculative import NgramDrafter
from sfcore_daemon.llama.kvcache import SeqCells
from sfcore_daemon.store.index import Entry
from sfcore_daemon.structured.forced import ForcedDrafts


class DraftParts(NamedTuple):
    """Where a draft's tokens came from, from the step that proposed it (drafting.py) to
    the one that verifies it (rows.py), in their order in the draft: `copied` (a string
    value's copy of the prompt), `forced` (a schema's grammar forces them), then either
    `guessed` (the n-gram drafter's own continuation) or `after` (its guess of what
    follows the forced text, which adapts apart). The rest only fill the step's rows."""

    forced: int = 0
    guessed: int = 0
    copied: int = 0
    after: int = 0


NO_PARTS = DraftParts()


class Seq(SeqCells):
    """One slot's sequence and the step loop's state for its job (decode thread only)."""

    __slots__ = ("job", "sampler", "argmax", "next_prompt", "chunk_end", "n_out", "limit",
                 "generating", "last_token", "parked", "drafter", "draft", "loading",
                 "keep_state", "keep_prefix", "continued", "prompt_kept", "boundaries",
                 "protect_from", "cuts", "penalties", "forced", "draft_parts")

    def __init__(self, seq_id: int) -> None:
        super().__init__(seq_id)
        self.job: Job | None = None
        self.sampler: Any = None
        # Its chain is an argmax: numpy's is taken (sampling.py), and a grammar checks it.
        self.argmax = False
        self.next_prompt = 0  # the first prompt token not yet in the cache
        self.chunk_end = 0  # the end of the prompt chunk in the current step
        self.n_out = 0
        self.limit = 0
        self.generating = False  # past its prompt: adds one token a step
        self.last_token = 0  # sampled, not yet decoded
        # Its next token is being drawn by a wide grammar pass on another thread; the
        # sequence sits out of the steps until then.
        self.parked: Future[int] | None = None
        # The job's repeat-penalty sampler (in its chain), kept for a grammar that
        # starts holding the output later (an "auto" tool call).
        self.penalties: Any = None
        # Speculative decoding (speculative.py): None when the job does not speculate.
        self.drafter: NgramDrafter | None = None
        self.draft: list[int] = []  # the tokens after last_token in this step's batch
        # The text a JSON schema's grammar forces, as drafts (structured/forced.py): None
        # when the job does not speculate or has no schema.
        self.forced: ForcedDrafts | None = None
        # Where `draft`'s tokens came from, for its verification.
        self.draft_parts = NO_PARTS
        # A state being read from disk for its prompt (entry, rows to keep, the read, its
        # monotonic deadline): it sits out of the steps until then (PromptStates.poll).
        self.loading: tuple[Entry, int, Future[bytearray | None], float] | None = None
        # Whether its cells may be kept in the prompt store (not after cache_prompt: false).
        self.keep_state = False
        # A prefix its prompt shares with an earlier text (a common system prompt): its
        # state is stored once the prompt is read, to be restored for the next one.
        self.keep_prefix = 0
        # The slot's text, when the prompt goes on from all of it (0: it does not): not
        # a prefix worth a state of its own, as the cells stay (kept when they go).
        self.continued = 0
        self.prompt_kept = False  # its prompt's states were taken (or were not worth it)
        # Where the states taken once the prompt is read end (its end, turn or line
        # starts), and the first row they need kept meanwhile (PromptStates.protect).
        self.boundaries: list[int] = []
        self.protect_from = -1  # -1: none
        # Where its prompt's chunks end besides n_batch multiples, ascending: the turn
        # or line starts a stored state may end at (storepolicy.PromptStates.cuts).
        self.cuts: list[int] = []
