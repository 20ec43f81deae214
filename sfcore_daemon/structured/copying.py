"""A string value copied from the prompt, drafted as the prompt's own tokens.

A document extracted from a text (a name, an address, an e-mail, a date) mostly copies
its string values from the prompt. The n-gram drafter (engine/speculative.py) finds such
copies token by token, but a value starts with other tokens than the same text in the
prompt (`"Margaret` is ` "` + `Margaret` there, ` Margaret` in the prose), so it only
catches up two or three tokens in. `PromptCopy` matches bytes instead: once the value so
far is a few bytes long and ends where a prompt token ends, the prompt's next tokens are
the draft, up to the first that holds a quote or a line break (a JSON string ends or
breaks there) or ends a phrase (a comma, a full stop before a space): there the value
likely ends too, and forced.py drafts its closing quote and the forced text after it.
The step loop verifies them like any other draft.

Decode thread only; built on a request's first string value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from sfcore_daemon.llama.model import Model

# The value so far must be this long to be looked up: shorter ones match anywhere.
MIN_MATCH_BYTES: Final = 3
# At most this many tokens a draft: a copy's end is the model's choice.
MAX_COPY: Final = 16
_STOPS: Final = (b'"', b"\n")
# A token that is this punctuation ends a phrase, so likely a copied value; a full stop
# or a colon only before whitespace (not inside an e-mail address or a time).
_PHRASE_ENDS: Final = frozenset((b",", b";", b"(", b")", b"!", b"?"))
_SENTENCE_ENDS: Final = frozenset((b".", b":"))


class PromptCopy:
    """One request's prompt as bytes, with where each of its tokens ends."""

    __slots__ = ("_tokens", "_pieces", "_text", "_next")

    def __init__(self, prompt: list[int], model: Model) -> None:
        cached = model.pieces
        pieces = [cached.get(token) or model.piece(token) for token in prompt]
        self._tokens = prompt
        self._pieces = pieces
        self._text = b"".join(pieces)
        # Byte offset where a token ends -> the index of the token after it.
        self._next: dict[int, int] = {}
        end = 0
        for index, piece in enumerate(pieces):
            end += len(piece)
            self._next[end] = index + 1

    def after(self, value: bytes, room: int) -> tuple[list[int], bool]:
        """The prompt's tokens that follow an occurrence of `value` that ends at a
        token's end (the last, or the first in its paragraph), at most `room`, up to the
        first token that
        holds a quote or a line break or ends a phrase; ([], False) otherwise. And
        whether the copy stopped at a phrase's end (where the value likely ends)."""
        if len(value) < MIN_MATCH_BYTES:
            return [], False
        found = self._text.rfind(value)
        if found < 0:
            return [], False
        start = self._next.get(found + len(value))
        if start is None or start >= len(self._tokens):
            return [], False
        text = self._text
        first = text.find(value, text.rfind(b"\n\n", 0, found) + 1)
        if first != found:
            # A text names a thing in full where it first mentions it, so the first occurrence
            # in the last one's paragraph is the likelier copy, if it ends at a token's end.
            other = self._next.get(first + len(value))
            if other is not None and other < len(self._tokens):
                start = other
        copied: list[int] = []
        pieces, count = self._pieces, len(self._tokens)
        for index in range(start, min(start + min(room, MAX_COPY), count)):
            piece = pieces[index]
            if any(stop in piece for stop in _STOPS):
                break
            if ends_phrase(pieces, index, True):
                return copied, True
            copied.append(self._tokens[index])
        return copied, False


def ends_phrase(pieces: list[bytes], index: int, at_end: bool) -> bool:
    """Whether `pieces[index]` is punctuation that ends a phrase, where a value copied
    from prose likely ends: `,;()!?`, or `.` or `:` before whitespace (`at_end`: whether
    the end of `pieces` counts as whitespace)."""
    bare = pieces[index].strip()
    if bare in _PHRASE_ENDS:
        return True
    if bare not in _SENTENCE_ENDS:
        return False
    return at_end if index + 1 == len(pieces) else pieces[index + 1][:1].isspace()
