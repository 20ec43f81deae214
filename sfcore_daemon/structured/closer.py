"""Closing a JSON document before max_tokens cuts it.

A `Closer` rides along with the `GrammarSampler` of a `json_schema` or `format: "json"`
request. Nothing of it runs until the tokens left drop to `window`; from then on, on
the decode thread, it follows the document with a `JsonTracker` and answers two
questions for the sampler:

- `fits_after(token, room)`: can the document still be completed in `room` tokens once
  `token` is written? (the shortest completion's bytes bound its tokens; only when the
  bytes do not fit is the completion tokenized and counted exactly)
- `plan(left, allows)`: the tokens of the shortest completion that the grammar accepts
  (checked on a copy of the grammar), ending with end-of-generation if there is room;
  None when no completion fits in `left` tokens.

The sampler emits a plan as forced tokens, each checked against the real grammar: the
draws near the end (`near_end`, `settle`) are the closer's, made with the sampler's own
draw and grammar (`Drawing`).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from sfcore_daemon.llama.capi import C
from sfcore_daemon.structured.shape import Shape
from sfcore_daemon.structured.tracker import JsonTracker

if TYPE_CHECKING:
    from sfcore_daemon.llama.model import Model

# The closer follows the document from this many tokens before the end, plus twice the
# schema's shortest document: room for most completions (a longer one is still tried).
BASE_WINDOW: Final = 32
# Completions tried, shortest first, when the tracker holds several readings.
_MAX_CANDIDATES: Final = 4


class Drawing(Protocol):
    """What the closer uses of the grammar sampler it rides along with (grammar.py)."""

    tokens: int  # tokens drawn, this one included
    limit: int  # the most tokens the request may emit
    eog: int  # end-of-generation
    closed_early: bool
    emitted: list[int]  # every token accepted so far

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next."""

    def accepts(self, tokens: list[int]) -> bool:
        """Whether the grammar allows `tokens` in order."""

    def draw(self, chain: Any, ctx: Any, idx: int, accept: bool = True) -> int | None:
        """The usual draw (narrow tiers; None: only a wide pass can find a token)."""

    def accept(self, token: int) -> None:
        """`token` is the document's next."""


class Closer:
    """Budget-aware completion for one request's JSON document."""

    __slots__ = ("shape", "window", "tracker", "fed", "forced", "lost", "completion_len",
                 "settling", "_model", "_buf")

    def __init__(self, shape: Shape, model: Model) -> None:
        self.shape = shape
        shortest = len(shape.shortest)
        self.window = BASE_WINDOW + 2 * min(shortest, 4096)
        self.tracker: JsonTracker | None = None  # built on the first call near the end
        self.fed = 0  # emitted tokens the tracker has read
        self.forced: deque[int] = deque()
        # Set when the tracker cannot follow the text or no completion can fit: from
        # then on the request samples as without a closer.
        self.lost = shortest >= 100000
        self.completion_len = 0  # planned tokens not yet forced, end-of-generation aside
        # The tokens left when a draw near the end went to a wide pass (0: none did).
        self.settling = 0
        self._model = model
        self._buf = ctypes.create_string_buffer(64)

    def near_end(self, sampler: Drawing, chain: Any, ctx: Any, idx: int) -> int | None:
        """A draw when the tokens left are close to what completing the document needs.

        Forced tokens first (a completion planned earlier). Otherwise the usual draw,
        narrow tiers only and nothing accepted yet; its token is kept when the document
        can still be completed in the tokens left after it. If not (or only a wide pass
        could find a token), the shortest completion is planned and its first token
        forced. The grammar checks every forced token; if it ever refused one, or no
        completion fits, the request goes on as if it had no closer.
        """
        left = sampler.limit - sampler.tokens + 1  # this token included
        if self.forced:
            token = self.forced.popleft()
            if sampler.allows(token):
                return self._force(sampler, chain, token)
            self.forced.clear()
            self.lost = True
            return sampler.draw(chain, ctx, idx)
        tracker = self.catch_up(sampler.emitted)
        if tracker is None:
            return sampler.draw(chain, ctx, idx)
        drawn = sampler.draw(chain, ctx, idx, accept=False)
        if drawn is None:  # a wide pass draws it, and settles it (sample_wide)
            self.settling = left
            return None
        return self.settle(sampler, tracker, chain, drawn, left)

    def settle(self, sampler: Drawing, tracker: JsonTracker, chain: Any, drawn: int,
               left: int) -> int:
        """Keep a drawn token if the document can still be completed after it, else
        force the first token of the shortest completion (when one fits)."""
        if C.llama_vocab_is_eog(self._model.vocab, drawn) or self.fits_after(
                tracker, drawn, left - 1):
            sampler.accept(drawn)
            return drawn
        if self.plan(tracker, left, sampler.eog, sampler.accepts):
            return self._force(sampler, chain, self.forced.popleft())
        sampler.accept(drawn)
        return drawn

    def _force(self, sampler: Drawing, chain: Any, token: int) -> int:
        C.llama_sampler_accept(chain, token)
        sampler.accept(token)
        if self.completion_len:
            self.completion_len -= 1
            sampler.closed_early = self.completion_len == 0
        return token

    def catch_up(self, emitted: list[int]) -> JsonTracker | None:
        """The tracker, having read every emitted token (once, lazily, the first time)."""
        tracker = self.tracker
        if tracker is None:
            tracker = self.tracker = JsonTracker(self.shape)
        if self.fed < len(emitted):
            tracker.feed(b"".join(self._piece(token) for token in emitted[self.fed:]))
            self.fed = len(emitted)
        if tracker.lost:
            self.lost = True
            return None
        return tracker

    def fits_after(self, tracker: JsonTracker, token: int, room: int) -> bool:
        """Whether the document can still be completed in `room` tokens after `token`;
        when it can, the tracker moves past the token."""
        after = tracker.copy()
        after.feed(self._piece(token))
        completions = after.completions()
        if completions and len(completions[0]) > room \
                and len(self.tokenize(completions[0])) > room:
            return False
        # Unknown (no reading, or none with a completion) counts as fitting: the
        # request then goes on as without a closer.
        self.tracker = after
        self.fed += 1
        if after.lost:
            self.lost = True
        return True

    def plan(self, tracker: JsonTracker, left: int, eog: int,
             allows: Callable[[list[int]], bool]) -> bool:
        """Fill `forced` with a completion the grammar accepts in at most `left` tokens,
        end-of-generation after it if there is room; False (and lost) if none fits."""
        for text in tracker.completions()[:_MAX_CANDIDATES]:
            tokens = self.tokenize(text) if text else []
            if len(tokens) > left or b"".join(map(self._piece, tokens)) != text:
                continue
            planned = [*tokens, eog] if len(tokens) < left and eog >= 0 else tokens
            if allows(planned):
                self.forced.extend(planned)
                self.completion_len = len(tokens)
                return True
        self.lost = True
        return False

    def tokenize(self, text: bytes) -> list[int]:
        """Tokens for raw bytes (the completion of a split character may not be UTF-8
        on its own), no BOS, special text not parsed."""
        return self._model.tokenize_bytes(text)

    def _piece(self, token: int) -> bytes:
        """A token's bytes: the model's cache, else looked up here (model.piece shares
        a buffer with the decode thread, and a wide pass's draw settles on another)."""
        model = self._model
        piece = model.pieces.get(token)
        if piece is not None:
            return piece
        buf = self._buf
        n = C.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(model.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]


def clone_accepts(grammar: ctypes.c_void_p, tokens: list[int],
                  allowed: Callable[[ctypes.c_void_p, int], bool]) -> bool:
    """Whether `grammar` accepts `tokens` in order, tried on a copy of it."""
    twin = C.llama_sampler_clone(grammar)
    if not twin:
        return False
    try:
        for token in tokens:
            if not allowed(twin, token):
                return False
            C.llama_sampler_accept(twin, token)
        return True
    finally:
        C.llama_sampler_free(twin)
