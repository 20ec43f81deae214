"""Grammar-constrained sampling: compile GBNF for the vocabulary, then sample with it.

- On the event loop, before a request is queued: `check_gbnf` refuses text llama.cpp's
  parser should not see, and `GrammarSampler.create` compiles it with llama.cpp. Every
  mistake is a `GrammarError`, answered as `invalid_request`.
- On the decode thread: `GrammarSampler.sample(chain, ctx, idx)` in place of
  `llama_sampler_sample(chain, ctx, idx)`. It keeps the grammar out of the chain, as
  llama.cpp's common sampler does: the chain samples as usual, only the chosen token is
  tested against the grammar, and only a rejected token costs a grammar pass over the
  most likely candidates and a second draw. A draw that needs a pass over 32768 tokens
  or the whole vocabulary is finished by `sample_wide` on a thread beside the steps.

The slow path's candidate array is candidates.py's; closing a JSON document before
max_tokens cuts it is closer.py's (`Closer.near_end`).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.logrouter import llama_log_router
from sfcore_daemon.structured.candidates import RESAMPLE_TIERS, Candidates, id_template, is_hidden
from sfcore_daemon.structured.closer import Closer, clone_accepts
from sfcore_daemon.structured.gbnfcheck import GrammarError, check_gbnf

if TYPE_CHECKING:
    from sfcore_daemon.llama.model import Model
    from sfcore_daemon.structured.shape import Shape

# check_gbnf and GrammarError live in gbnfcheck.py; the request path and the tests know
# them as grammar's.
__all__ = ["GrammarDeadEnd", "GrammarError", "GrammarSampler", "check_gbnf"]


class GrammarDeadEnd(Exception):
    """The grammar allows no token where the document stands. It ends that request
    alone: `at_start` (nothing accepted yet) means the grammar itself admits nothing."""

    def __init__(self, at_start: bool, budget_s: float = 0.0) -> None:
        if budget_s:
            message = (f"the grammar's checks of the model's tokens used their {budget_s:g} s "
                       f"budget of CPU time (server.grammar_budget_s): the model keeps "
                       f"choosing tokens the grammar rejects, or the grammar is costly to "
                       f"follow")
        elif at_start:
            message = "the grammar allows no token at its start"
        else:
            message = "the grammar allows no token to continue the document"
        super().__init__(message)
        self.at_start = at_start


# Tiers from this one on, and the whole-vocabulary pass, are too slow for the shared step:
# they run on a thread of their own, bounded by server.grammar_budget_s.
_WIDE_TIER: Final = 2


# --- llama.cpp's parse errors ------------------------------------------------------


def _split_parse_error(captured: str, text: str) -> tuple[str, str]:
    """(llama.cpp's reason, everything else) from what was printed to fd 2 while a grammar
    was parsed. llama.cpp prints "parse: error parsing grammar: REASON\n\nGRAMMAR\n",
    REASON itself running on to the end of the grammar text."""
    marker = "error parsing grammar: "
    start = captured.find(marker)
    if start < 0:
        return "", captured
    reason = captured[start + len(marker):].split("\n", 1)[0].strip()
    if len(reason) > 200:
        reason = reason[:200] + "..."
    block_start = captured.rfind("\n", 0, start) + 1
    block_end = captured.find("\n\n" + text + "\n", start)
    block_end = len(captured) if block_end < 0 else block_end + len(text) + 3
    return reason, captured[:block_start] + captured[block_end:]


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """Collect what C code writes to fd 2 meanwhile (llama.cpp prints grammar parse
    errors there, with the whole grammar, not through its log callback)."""
    out: list[str] = []
    try:
        sink = os.memfd_create("sfcore-grammar-errors")
    except OSError:
        yield out
        return
    saved = os.dup(2)
    try:
        os.dup2(sink, 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
        os.lseek(sink, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(sink, 1 << 16):
            chunks.append(chunk)
        out.append(b"".join(chunks).decode("utf-8", errors="replace"))
    finally:
        os.close(saved)
        os.close(sink)


# --- the sampler ------------------------------------------------------------------------


class GrammarSampler:
    """One request's grammar, and the fast path around the request's sampler chain.

    Created on the event loop; from then on used by the decode thread only, which frees
    it when the job ends. A sampler that never reached the decode thread is freed when
    it is collected.
    """

    __slots__ = ("_grammar", "_vocab", "_one", "_one_array", "_prompt", "_history",
                 "_penalties", "_candidates", "n_vocab", "tokens", "resampled", "full_passes",
                 "field", "used_ns", "budget_ns", "_kept_logits", "limit", "closer",
                 "closed_early", "emitted", "eog")

    def __init__(self, grammar: Any, vocab: Any, n_vocab: int, prompt: list[int]) -> None:
        self._grammar = grammar
        self._vocab = vocab
        self.n_vocab = n_vocab
        self._one = C.llama_token_data(0, 0.0, 0.0)
        self._one_array = C.llama_token_data_array(
            ctypes.pointer(self._one), 1, -1, False)
        # The repeat penalty's past (prompt tail, accepted tokens), rebuilt by a masked draw
        # as the chain already recorded the rejected token; sized by `begin`.
        self._prompt = prompt
        self._history: deque[int] = deque(maxlen=0)
        self._penalties: Any = None
        self._candidates = Candidates(vocab, n_vocab)
        # Tokens sampled and those that needed the slow path, read by the loop at the end.
        self.tokens = 0
        self.resampled = 0
        self.full_passes = 0
        # The request field the grammar came from, for error messages.
        self.field = "grammar"
        # CPU time (not wall time, which load stretches) spent on the grammar and its limit
        # (0: none); even fast-path checks count, as a grammar's stacks can multiply.
        self.used_ns = 0
        self.budget_ns = 0
        # The logits of a draw that only a wide pass can finish (see sample_wide).
        self._kept_logits = b""
        # Budget-aware completion of JSON documents (closer.py): the sequence's token limit (set
        # at the job's start), whether it closed early to fit, and the tokens accepted so far.
        self.limit = 0
        self.closer: Closer | None = None
        self.closed_early = False
        self.emitted: list[int] = []
        self.eog = -1

    @classmethod
    def create(cls, model: Model, text: str, field: str, prompt: list[int],
               budget_s: float = 0.0, *, shape: Shape | None = None) -> GrammarSampler:
        """Compile `text` (from the request's `field`) for `model`'s vocabulary;
        GrammarError with llama.cpp's reason if it does not parse. Event loop only (it
        reads the vocabulary). `shape`: the JSON document the grammar describes, for
        closing it early when the budget runs out."""
        encoded = text.encode("utf-8")
        with model.using_vocab(), llama_log_router.capturing_errors() as errors, \
                _stderr_captured() as printed:
            grammar = C.llama_sampler_init_grammar(model.vocab, encoded, b"root")
        reason, rest = _split_parse_error("".join(printed), text)
        if rest:  # someone else's output, written while fd 2 was redirected
            os.write(2, rest.encode("utf-8", errors="replace"))
        if not grammar:
            reason = reason or (errors[0] if errors else "llama.cpp refused it")
            source = "the grammar" if field == "grammar" else "the grammar made from it"
            raise GrammarError(f"{source} does not parse: {reason} - at `$.{field}`")
        id_template(model.info.n_vocab)  # built once, here rather than mid-generation
        sampler = cls(grammar, model.vocab, model.info.n_vocab, prompt)
        sampler.field = field
        sampler.budget_ns = int(budget_s * 1e9)
        eog = C.llama_vocab_eos(model.vocab)
        if eog < 0 or not C.llama_vocab_is_eog(model.vocab, eog):
            eog = C.llama_vocab_eot(model.vocab)
        sampler.eog = eog
        if shape is not None:
            sampler.closer = Closer(shape, model)
        return sampler

    @property
    def shape(self) -> Shape | None:
        """The JSON document the grammar describes (None for a GBNF grammar)."""
        return None if self.closer is None else self.closer.shape

    def planned(self, room: int) -> list[int]:
        """The tokens of the completion the closer has planned and will emit whatever
        the model draws (end-of-generation aside), at most `room`; [] when none is."""
        closer = self.closer
        if closer is None or not closer.forced:
            return []
        tokens = list(itertools.islice(closer.forced, room))
        if tokens and tokens[-1] == self.eog:
            tokens.pop()
        return tokens

    def begin(self, limit: int, penalties: Any, penalty_last_n: int) -> None:
        """The job starts (decode thread): it may emit at most `limit` tokens; its chain's
        repeat penalty (None: none) looks back over `penalty_last_n` tokens."""
        self.limit = limit
        self._penalties = penalties
        prompt, self._prompt = self._prompt, []
        self._history = deque(prompt[-penalty_last_n:], maxlen=penalty_last_n)

    def complete(self) -> bool:
        """Whether the grammar would end the document here: it allows end-of-generation
        (read at the token limit, so that a document completed by its last allowed
        token ends as "stop"). Decode thread only."""
        return self._grammar is not None and self.eog >= 0 and self._allows(
            self._grammar, self.eog)

    def _allows(self, grammar: Any, token: int) -> bool:
        one: Any = self._one
        one.id = token
        one.logit = 0.0
        array = self._one_array
        array.size = 1
        array.selected = -1
        C.llama_sampler_apply(grammar, ctypes.byref(array))
        return bool(one.logit != -math.inf)

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next."""
        return self._allows(self._grammar, token)

    def accepts(self, tokens: list[int]) -> bool:
        """Whether the grammar allows `tokens` in order (tried on a copy of it)."""
        return clone_accepts(self._grammar, tokens, self._allows)

    def sample(self, chain: Any, ctx: Any, idx: int, first: int = -1) -> int | None:
        """The next token: the chain's choice when the grammar allows it, else a draw
        from the tokens the grammar allows among the likeliest. None when only a wider
        pass can find one: the logits are kept, and `sample_wide` finishes the draw
        (off the decode thread). Near the end of a JSON request's budget, see
        `Closer.near_end`. `first`: the chain's choice when the caller has it (an
        argmax chain's, numpy's argmax of the row), -1 otherwise. Decode thread only;
        GrammarDeadEnd once the request has used its budget of grammar CPU time."""
        self._check_budget()
        started = time.thread_time_ns()
        try:
            self.tokens += 1
            closer = self.closer
            if closer is not None and self.limit - self.tokens < closer.window \
                    and not closer.lost:
                return closer.near_end(self, chain, ctx, idx)
            return self.draw(chain, ctx, idx, first=first)
        finally:
            self.used_ns += time.thread_time_ns() - started

    def draw(self, chain: Any, ctx: Any, idx: int, accept: bool = True,
             first: int = -1) -> int | None:
        """`sample` without the budget check and the closer; the token accepted only if
        `accept`."""
        token: int = first if first >= 0 else C.llama_sampler_sample(chain, ctx, idx)
        if self._allows(self._grammar, token) and not is_hidden(self._vocab, token):
            if accept:
                self.accept(token)
            return token
        return self._resample(chain, ctx, idx, accept)

    def _resample(self, chain: Any, ctx: Any, idx: int, accept: bool = True) -> int | None:
        """The slow path (candidates.py): mask what the grammar rejects, then run the
        chain again. The narrow tiers run here, in the step; the wide ones would hold up
        every other sequence, so the step loop runs them on another thread."""
        grammar = self._grammar
        self.resampled += 1
        logits = ctypes.string_at(C.llama_get_logits_ith(ctx, idx), 4 * self.n_vocab)
        candidates = self._candidates
        for tier in range(_WIDE_TIER):
            if candidates.mask(logits, tier, grammar):
                return self._draw_masked(chain, accept)
        self._kept_logits = logits
        return None

    def accept(self, token: int) -> None:
        """`token` is the document's next: the grammar and the penalty's history move on."""
        C.llama_sampler_accept(self._grammar, token)
        self._history.append(token)
        self.emitted.append(token)

    def sample_wide(self, chain: Any) -> int:
        """Finish a draw `sample` left: the wide tiers, then the whole vocabulary, over
        the kept logits. Runs while the sequence sits out of the steps, on a thread of
        its own; bounded by the request's budget of this thread's CPU time."""
        logits, self._kept_logits = self._kept_logits, b""
        assert logits
        candidates = self._candidates
        for tier in range(_WIDE_TIER, len(RESAMPLE_TIERS)):
            self._check_budget()
            started = time.thread_time_ns()
            found = candidates.mask(logits, tier, self._grammar)
            self.used_ns += time.thread_time_ns() - started
            if found:
                return self._finish_wide(chain)
        self._check_budget()
        started = time.thread_time_ns()
        self.full_passes += 1
        candidates.mask(logits, None, self._grammar)
        self.used_ns += time.thread_time_ns() - started
        return self._finish_wide(chain)

    def _finish_wide(self, chain: Any) -> int:
        started = time.thread_time_ns()
        try:
            closer = self.closer
            if closer is None or not closer.settling:
                return self._draw_masked(chain)
            # A draw near the end (Closer.near_end) went to this pass: settled here.
            left, closer.settling = closer.settling, 0
            if closer.tracker is None:
                return self._draw_masked(chain)
            drawn = self._draw_masked(chain, accept=False)
            return closer.settle(self, closer.tracker, chain, drawn, left)
        finally:
            self.used_ns += time.thread_time_ns() - started

    def _draw_masked(self, chain: Any, accept: bool = True) -> int:
        """Run the chain over the grammar-masked candidates; accept its choice (into
        the grammar only if `accept`)."""
        token = self._candidates.draw(chain, self._penalties, self._history)
        if token < 0:
            raise GrammarDeadEnd(at_start=self.tokens == 1)
        C.llama_sampler_accept(chain, token)
        if accept:
            self.accept(token)
        return token

    def _check_budget(self) -> None:
        """The decode steps and the one grammar thread are shared by every request: past
        its budget a request ends (grammar_dead_end) rather than hold them up."""
        if self.budget_ns and self.used_ns >= self.budget_ns:
            raise GrammarDeadEnd(at_start=False, budget_s=self.budget_ns / 1e9)

    def free(self) -> None:
        grammar, self._grammar = self._grammar, None
        if grammar:
            C.llama_sampler_free(grammar)
        # The chain owns it; the job ends with the chain.
        self._penalties = None
        self._candidates.free()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit C may be gone
            self.free()
