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

The sampler emits a plan as forced tokens, each checked against the real grammar.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from sfcore_daemon.llama.capi import C
from sfcore_daemon.structured.shape import Shape
from sfcore_daemon.structured.tracker import JsonTracker

if TYPE_CHECKING:
    from sfcore_daemon.llama.model import Model

# The closer starts following the document this many tokens before the end, plus
# twice the bytes of the schema's shortest document: enough for any completion the
# text can come to need in most documents (one that needs more is still tried).
BASE_WINDOW: Final = 32
# Completions tried, shortest first, when the tracker holds several readings.
_MAX_CANDIDATES: Final = 4


class Closer:
    """Budget-aware completion for one request's JSON document."""

    __slots__ = ("shape", "window", "tracker", "fed", "forced", "lost", "completion_len",
                 "_model", "_buf")

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
        self._model = model
        self._buf = ctypes.create_string_buffer(64)

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
        model = self._model
        capacity = len(text) + 8
        ids = (C.llama_token * capacity)()
        with model.using_vocab():
            n = C.llama_tokenize(model.vocab, text, len(text), ids, capacity, False, False)
        return list(ids[:n]) if n >= 0 else []

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
