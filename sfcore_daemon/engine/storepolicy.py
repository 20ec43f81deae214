"""The engine's side of the prompt store (store/*), on the decode thread: which stored
state a new prompt restores, where its prompt is cut into chunks, and which states of
its cells are kept, and when. The one engine module that talks to the store: the step
loop and containment.py go through `PromptStates`; the Engine (thread.py) gets the
store's type and its fingerprint (`store_fingerprint`) from here.

A state continues only where its text ends, and a sliding-window model's state holds
just the last window of its window layers, so states are taken at places the next
prompt is likely to leave the text: a prompt's end, the last turn or line starts of its
tail, a prefix two prompts share, a slot's cells before they are overwritten.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections.abc import Sequence
from typing import TypeVar

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.engine.job import Job
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.kvcache import KVCache, shared_prefix
from sfcore_daemon.llama.model import Model, llama_cpp_version
from sfcore_daemon.store.fingerprint import state_fingerprint
from sfcore_daemon.store.promptstore import Entry, PromptStore

__all__ = ["Entry", "PromptStates", "PromptStore", "store_fingerprint"]

_T = TypeVar("_T")


# Prompt tokens a stored state must save beyond what the slots give, to be restored:
# restoring costs about what evaluating a few tokens does.
_RESTORE_GAIN = 16
# A long prompt's state is also kept at its tail's last turn or line starts (see _boundaries):
# a state continues only where its text ends, and the next prompt tends to leave it there.
_BOUNDARIES = 2
_BOUNDARY_SCAN = 512  # tokens before the prompt's end searched for them
_BOUNDARY_GAP = 8  # tokens at least between two kept boundaries
# Tokens a longer stored state may save over one that ends at a chunk cut, for the
# latter to be restored (it gives the cold run's bytes; see PromptStates.cuts).
_EXACT_SLACK = 32


class PromptStates:
    """Restores and keeps the states of the slots' sequences. With `store` None (no
    store) nothing is kept or cut, and `restore` is never called."""

    def __init__(self, store: PromptStore | None, cells: KVCache, model: Model, n_swa: int,
                 seqs: Sequence[Seq]) -> None:
        self._store = store
        self._cells = cells
        self._model = model
        self._vocab = model.vocab
        self._n_swa = n_swa
        self._seqs = seqs

    @property
    def enabled(self) -> bool:
        return self._store is not None

    def wait_for_work(self, inbox: queue.SimpleQueue[_T]) -> _T:
        """The step loop's next item of work, once it comes: the store writes its files
        while the loop waits for it."""
        store = self._store
        if store is None:
            return inbox.get()
        store.engine_idle(True)
        try:
            return inbox.get()
        finally:
            store.engine_idle(False)

    def restore(self, seq: Seq, job: Job) -> None:
        """Give `seq` a stored state of the prompt's prefix when it is longer than what
        the slots hold: at once from RAM, or from disk through the reader thread.
        A prefix shared with an earlier text but stored nowhere is marked for keeping."""
        store = self._store
        assert store is not None
        # A state ending at one of the prompt's cuts, restored into an empty pool, gives the
        # cold run's bytes (KVCache.restore); beside other slots' cells there are none to get.
        cuts = seq.cuts if self._cells.can_place(seq) else ()
        entry, n, shared = store.find(job.spec.prompt, cuts, _EXACT_SLACK)
        common = max(shared, job.n_cached)
        # A conversation's next turn shares its slot's whole text: that text's state is
        # taken when the slot's cells go, not between the turn's first tokens.
        if (common >= store.min_tokens and common > (n if entry is not None else 0)
                and common > seq.continued):
            seq.keep_prefix = common
        if entry is None or n < job.n_cached + _RESTORE_GAIN:
            return
        data = store.take_ram(entry)
        if data is None:
            if store.read_overdue():
                return  # a read is stuck on the disk: evaluate rather than queue behind it
            deadline = time.monotonic() + store.read_timeout_s
            seq.loading = (entry, n, store.load(entry), deadline)
            return
        if self._cells.restore(seq, data, entry.tokens, n, place=n in seq.cuts):
            job.n_cached, job.cache_source = n, "ram"
        else:
            self._count_error()
            job.n_cached, job.cache_source, job.restore_failed = 0, "none", True

    def poll(self, seq: Seq) -> None:
        """Each step while `seq` waits for a state from disk: restore it once read; past
        [cache] disk_read_timeout_ms (a hung disk) give up on it and evaluate the prompt."""
        loading, job = seq.loading, seq.job
        assert loading is not None and job is not None and self._store is not None
        if loading[2].done():
            self.loaded(seq)
        elif time.monotonic() >= loading[3]:
            entry, read = loading[0], loading[2]
            read.cancel()  # if it is still queued behind another
            seq.loading = None
            self._store.read_abandoned()
            # Logged on the event loop, from the job's end record: the decode thread
            # does no logging.
            job.notices.append(
                f"prompt cache: gave up reading {entry.path} after "
                f"{self._store.read_timeout_s * 1000:.0f} ms; the prompt is evaluated "
                "(restores skip the disk tier while the read is stuck)")
            seq.next_prompt = job.n_cached
            self.protect(seq, job)

    def loaded(self, seq: Seq) -> None:
        """A state read from disk is there (or could not be read): restore it, or go
        on with what the slot held."""
        assert seq.loading is not None and seq.job is not None
        (entry, n, read, _), seq.loading = seq.loading, None
        job = seq.job
        try:
            data = read.result()
        except Exception:  # a reader bug must not fail the request: evaluate instead
            data = None
        if data is None:
            return  # the reader removed a bad file and warned; the prompt is evaluated
        if self._cells.restore(seq, data, entry.tokens, n, place=n in seq.cuts):
            job.n_cached, job.cache_source = n, "disk"
        else:
            self._count_error()
            job.n_cached, job.cache_source, job.restore_failed = 0, "none", True
        seq.next_prompt = job.n_cached
        self.protect(seq, job)

    def keep_prompt(self, seq: Seq, job: Job) -> None:
        """The states worth keeping of a prompt just read: those `protect` planned (its
        last turn or line starts and the whole prompt, if it took long to evaluate), and
        a prefix it shares with an earlier text."""
        store = self._store
        seq.prompt_kept = True
        if store is None:
            return
        try:
            # First: a turn start at a mark is then the pinned state, not a copy of it.
            self.pin(seq, job)
            for boundary in seq.boundaries:
                self.keep(seq, boundary)
            if seq.keep_prefix:
                self.keep(seq, seq.keep_prefix, exact=True)
        finally:
            self.unprotect(seq)

    def pin(self, seq: Seq, job: Job) -> None:
        """The states of the prompt's cache marks (`JobSpec.pins`), pinned in the store
        for their TTLs: a stored state of exactly that prefix has its pin restarted,
        else one is taken now (`job.pinned`: the longest taken)."""
        store = self._store
        if store is None or not seq.keep_state:
            return
        for n, seconds in job.spec.pins:
            if n < store.min_tokens or n > len(seq.cached):
                continue
            tokens = seq.cached[:n]
            if store.pin(tokens, seconds):
                continue
            data = self._cells.state(seq, n)
            if data is not None and store.put(tokens, data, seconds):
                job.pinned = max(job.pinned, n)

    def protect(self, seq: Seq, job: Job) -> None:
        """Plan the states its prompt gives once read, and which rows they need kept
        from llama.cpp's reuse until then: a state of a prefix ending at b needs the
        window before b, rows a sliding-window cache hands to other sequences' tokens
        once the prompt has gone a window past them (under 8-slot churn 2 of 12
        system prompts had lost theirs: every one of their next requests was cold)."""
        store = self._store
        seq.boundaries = []
        if store is None or not seq.keep_state:
            return
        if len(job.spec.prompt) - job.n_cached >= store.min_tokens:
            # The longest first: keep() lets a state go that a stored prefix nearly holds.
            seq.boundaries = _spaced([*seq.cuts, len(job.spec.prompt)])[::-1]
        pins = (n for n, _ in job.spec.pins)
        marks = [b for b in (*seq.boundaries, seq.keep_prefix, *pins) if b > 0]
        if marks and self._n_swa:
            seq.protect_from = max(0, min(marks) - self._n_swa)

    def unprotect(self, seq: Seq) -> None:
        if seq.protect_from >= 0:
            self._cells.release(seq)
            seq.protect_from = -1

    def keep(self, seq: Seq, n: int, *, exact: bool = False) -> None:
        """Save the state of `seq`'s first `n` cells in the prompt store, unless short
        or within min_tokens of a stored prefix of them: a slot that answered a
        question after a restored system prompt is let go without a copy of its
        cells (under churn that was a copy and a disk write per request, each the
        size of the whole prefix, for a few dozen tokens of gain). `exact`: a prefix
        other prompts share, worth its own state unless a stored one ends less than
        _RESTORE_GAIN tokens before it (restored there, the next prompt evaluates just
        what differs): under churn, states that saved a few tokens each held the step
        loop far longer than they saved (docs/performance/prompt-store.md)."""
        store = self._store
        if store is None or not seq.keep_state or n < store.min_tokens or n > len(seq.cached):
            return
        tokens = seq.cached[:n]
        if store.stored_already(tokens, _RESTORE_GAIN if exact else None):
            return
        data = self._cells.state(seq, n)
        if data is not None:
            store.put(tokens, data)

    def before_reuse(self, seq: Seq, prompt: list[int]) -> None:
        """Before `seq`'s cells serve `prompt`: their state is kept if the prompt parts
        from them (they are about to be overwritten); `seq.continued` says whether it
        goes on from all of them."""
        own = shared_prefix(seq.cached, prompt)
        if own < len(seq.cached):
            self.keep(seq, len(seq.cached))
        seq.continued = own if own == len(seq.cached) else 0

    def cuts(self, prompt: list[int]) -> list[int]:
        """Where a prompt long enough for the prompt store is cut into chunks besides
        n_batch multiples while it is read alone (steploop): its last _BOUNDARIES turn
        or line starts, whose states are kept once it is read. A state restored there
        continues with the rows a cold run reads next, row for row, so the restored
        prompt computes the cold run's bytes (the window rows placed,
        kvcache.KVCache.restore). The extra decode calls cost nothing measurable
        (docs/performance/prompt-store.md). Depends only on the prompt, not on the cache."""
        store = self._store
        if store is None or len(prompt) <= store.min_tokens:
            return []
        return self._boundaries(prompt, store.min_tokens)[::-1]

    def _boundaries(self, prompt: list[int], lowest: int) -> list[int]:
        """The last _BOUNDARIES turn or line starts in `prompt`'s tail, at `lowest` or
        later (see _BOUNDARIES)."""
        found: list[int] = []
        vocab, model = self._vocab, self._model
        pieces = model.pieces
        stop = max(lowest, len(prompt) - _BOUNDARY_SCAN) - 1
        for index in range(len(prompt) - 2, stop, -1):
            token = prompt[index]
            if C.llama_vocab_is_control(vocab, token):
                boundary = index  # the state ends before the control token
            else:
                piece = pieces.get(token)
                if piece is None:
                    piece = model.piece(token)
                if b"\n" not in piece:
                    continue
                boundary = index + 1  # after the newline
            # (The whole prompt's own state serves the prompt sent again.)
            if (boundary < lowest or boundary >= len(prompt) - 1
                    or (found and found[-1] - boundary < _BOUNDARY_GAP)):
                continue
            found.append(boundary)
            if len(found) == _BOUNDARIES:
                break
        return found

    def keep_all(self) -> None:
        """At shutdown: every slot's cells into the store (the daemon drains first),
        held to the gain of a shared prefix: after a restart a conversation's next turn
        goes on from its last answer, not from its prompt's last line start."""
        for seq in self._seqs:
            self.keep(seq, len(seq.cached), exact=True)

    def _count_error(self) -> None:
        """A failed restore or keep, counted in the store's `errors` (the stats op)."""
        if self._store is not None:
            self._store.counters.errors += 1


def _spaced(ends: list[int]) -> list[int]:
    """Of a prompt's ascending cuts and its end, the states worth taking: each at least
    _EXACT_SLACK tokens past the last one taken. A closer one saves less than that over
    a state at a cut, which `find` prefers anyway where a restore can give the cold
    run's bytes; and every state of a long prompt is a copy of all its rows (a chat's
    turn starts and its end: three, all but equal, each slowing the answer's decode)."""
    taken: list[int] = []
    for end in ends:
        if not taken or end - taken[-1] >= _EXACT_SLACK:
            taken.append(end)
    return taken


def store_fingerprint(sha256: concurrent.futures.Future[str],
                      rewritten: concurrent.futures.Future[bool], config: ModelConfig) -> str:
    """The fingerprint of the states this model and context make (store/fingerprint.py).
    Runs on the store's thread: it waits for the model file's sha256 (Engine hashes it
    once, for this and for the replies' fingerprint) and for the load's weights file."""
    return state_fingerprint(
        model_sha256=sha256.result(), rewritten=rewritten.result(),
        llama_cpp=llama_cpp_version(),
        flash_attn=config.flash_attn,
        n_ubatch=min(config.n_ubatch, config.n_batch),
        gpu_layers=config.n_gpu_layers,
        system_info=C.llama_print_system_info().decode(errors="replace"))
