"""The text a JSON schema's grammar leaves no choice about, as draft tokens.

Inside a constrained document much of the text is fixed by where the document stands:
the only property name left and its `": "`, the `, "` before the next required one,
the closing `"}` of an object whose last property was written, the rest of an enum value
once its first bytes tell it from the others. The model samples each of those tokens
one step at a time all the same. `ForcedDrafts` proposes them as a draft instead, which
the step loop verifies like any other (engine/rows.py): a draft token is emitted only
where the model's own draw from its row, through the grammar, equals it. So these drafts
change how many tokens a step takes, never which tokens are emitted (beyond the
rounding of several rows in one step, see docs/performance/speculative.md "Numerics").

`ForcedText` follows the document with a `JsonTracker` and asks each reading which bytes
may come next (`JsonTracker.nexts`); while exactly one can, that byte is forced. The
grammar's optional space (one `" "?` after punctuation and values) is not a choice the
grammar makes: it is drafted the way this model has written it so far in the document,
between the same two bytes (a model may write `"a": 1` and `"b" }`), else after the same
byte, else as json.dumps does (a space after `:` and `,`, none elsewhere).
The forced bytes are tokenized as the model's tokenizer would write them alone (a forced
text can be written in several tokenizations; the model mostly writes this one, and where
it does not, the draft ends at the first token it disagrees with).

Decode thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from sfcore_daemon.structured.copying import MAX_COPY, PromptCopy, ends_phrase
from sfcore_daemon.structured.frames import ANY_BYTE, SPACE, WS
from sfcore_daemon.structured.tracker import JsonTracker

if TYPE_CHECKING:
    from sfcore_daemon.llama.model import Model
    from sfcore_daemon.structured.shape import Shape

# Forced bytes looked at per draft token of room, as punctuation and key tokens are at most
# this long; a text cut here drops its last token, which may be cut inside.
_BYTES_PER_TOKEN: Final = 8
_QUOTE: Final = ord('"')
_VALUES: Final = 2  # ForcedDrafts.values, at first and after a draft refused
_MAX_VALUES: Final = 16
# Forced texts tokenized, kept per request (the same keys come back in every item of an
# array); emptied whole when full.
_TOKENIZED: Final = 256
# The punctuation a space follows by default, before the document says otherwise (as
# json.dumps and most models write JSON).
_SPACED_BY_DEFAULT: Final = frozenset(b":,")
# The longest forced draft, and the most tokens a kind of draft pauses for (Backoff).
MAX_FORCED: Final = 64
_MAX_PAUSE: Final = 64
_DIGIT_CLASS: Final = ord("0")
_LETTER_CLASS: Final = ord("a")


def _kind(byte: int) -> int:
    """The class a byte's spacing habit is kept under: digits as one (a number's end),
    letters as one (true, false, null), punctuation each its own."""
    if 0x30 <= byte <= 0x39:
        return _DIGIT_CLASS
    if 0x61 <= byte <= 0x7A or 0x41 <= byte <= 0x5A:
        return _LETTER_CLASS
    return byte


class ForcedText:
    """Where a document stands, the model's spacing habit, and the bytes forced next."""

    __slots__ = ("_tracker", "_spacing", "_between", "_last", "_spaced", "_string",
                 "before_choice")

    def __init__(self, shape: Shape) -> None:
        self._tracker = JsonTracker(shape)
        # Whether the model wrote a space after a class of byte (_kind), the last time
        # one was followed by punctuation; and between such a byte and the punctuation.
        self._spacing: dict[int, bool] = {}
        self._between: dict[tuple[int, int], bool] = {}
        self._last = -1  # the document's last byte other than whitespace
        self._spaced = False  # whitespace followed it
        self._string: bytearray | None = None  # the string value being written
        # Whether the forced text ended where the model picks punctuation: it mostly writes
        # the last forced bytes and its choice as one token (`"},`), refusing the draft's.
        self.before_choice = False

    @property
    def lost(self) -> bool:
        """The tracker cannot follow the text (nothing is forced from then on)."""
        return self._tracker.lost

    @property
    def string(self) -> bytes | None:
        """The string value being written, so far (None outside one)."""
        return None if self._string is None else bytes(self._string)

    @property
    def last(self) -> int:
        """The document's last byte so far (-1: none yet)."""
        return -1 if self._spaced else self._last

    def feed(self, data: bytes) -> None:
        """The document's next bytes, as the model wrote them."""
        tracker = self._tracker
        spacing = self._spacing
        for byte in data:
            if byte in WS:
                self._spaced = True
            else:
                if self._last >= 0 and not tracker.in_text():
                    kind = _kind(self._last)
                    spacing[kind] = self._between[kind, byte] = self._spaced
                self._last = byte
                self._spaced = False
            tracker.feed(bytes((byte,)))
            if tracker.lost:
                self._string = None
                return
            if not tracker.in_string():
                self._string = None
            elif self._string is None:
                self._string = bytearray()  # `byte` was its opening quote
            else:
                self._string.append(byte)

    def fits(self, data: bytes, values: int = 0) -> int:
        """How many of `data`'s first bytes the document can take from here: up to the
        first byte no reading allows, or the byte that completes the document (none
        once it is whole: what follows is its end, which no draft foretells). Given
        `values`, also up to the `values`-th value of the model's choosing that starts
        after forced bytes (a string's or a number's first byte, an enum's; not
        punctuation such as `,` or `]`)."""
        probe = self._tracker.copy()
        after_forced = False
        for index, byte in enumerate(data):
            if probe.whole:
                return index
            if values:
                allowed = probe.nexts()
                choices = None if allowed is None else allowed - _SPACE_SET
                if choices is not None and len(choices) == 1 and ANY_BYTE not in choices:
                    after_forced = True
                elif after_forced and (choices is None or any(
                        choice in (ANY_BYTE, _QUOTE) or _is_word(choice)
                        for choice in choices)):
                    values -= 1
                    if values == 0:
                        return index
                    after_forced = False
            probe.feed(bytes((byte,)))
            if probe.lost:
                return index
        return len(data)

    def _wants_space(self, last: int, following: int) -> bool:
        """Whether the model would write a space between `last` and `following`
        (ANY_BYTE: the start of a value of its choosing)."""
        kind = _kind(last)
        spaced = self._between.get((kind, following))
        if spaced is None:
            spaced = self._spacing.get(kind)
        return kind in _SPACED_BY_DEFAULT if spaced is None else spaced

    def text(self, limit: int) -> bytes:
        """The bytes forced from here, at most `limit` of them (b"" when the next byte
        is the model's choice). A space is included where the grammar allows one and
        the model's habit puts one."""
        probe = self._tracker
        if probe.lost:
            return b""
        return self._forced(probe, False, self._last, self._spaced, limit)

    def text_after(self, data: bytes, limit: int) -> bytes | None:
        """`text` once `data` follows what the document holds (None when the document
        refuses `data`)."""
        probe = self._tracker.copy()
        probe.feed(data)
        if probe.lost or not data:
            return None
        stripped = data.rstrip(b" \t\n\r")
        last = stripped[-1] if stripped else self._last
        return self._forced(probe, True, last, len(stripped) < len(data), limit)

    def _forced(self, probe: JsonTracker, copied: bool, last: int, spaced: bool,
                limit: int) -> bytes:
        """The forced bytes from the state of `probe` (fed on a copy of it unless
        `copied`), the document's last byte `last` and whether a space followed it."""
        out = bytearray()
        self.before_choice = False
        while len(out) < limit:
            allowed = probe.nexts()
            if allowed is None:
                break
            choices = allowed - _SPACE_SET
            # One byte is forced; or a value of the model's choosing starts, which the
            # model's habit may put a space before.
            following = next(iter(choices)) if len(choices) == 1 else ANY_BYTE
            if following == ANY_BYTE and ANY_BYTE not in choices:
                # Punctuation of the model's choosing; not a string value's first letter,
                # which it writes apart from the quote before it (` "` + `engineer`).
                self.before_choice = not (out[-1:] == b'"' and all(
                    _is_word(choice) for choice in choices))
                break
            if SPACE in allowed and not spaced and last >= 0 \
                    and self._wants_space(last, following):
                if not copied:
                    probe, copied = probe.copy(), True
                probe.feed(b" ")
                out.append(SPACE)
                spaced = True
            if following == ANY_BYTE:
                break
            byte = following
            if not copied:
                probe, copied = probe.copy(), True
            probe.feed(bytes((byte,)))
            if probe.lost:  # allowed by a reading's nexts, refused by its feed
                break
            out.append(byte)
            last, spaced = byte, False
        return bytes(out[:limit])


_SPACE_SET: Final = frozenset((SPACE,))


def _is_word(byte: int) -> bool:
    return _kind(byte) in (_DIGIT_CLASS, _LETTER_CLASS) if byte >= 0 else False


class ForcedDrafts:
    """One constrained request's forced text, as the tokens of a draft.

    Drafts only save steps: a failure in here (a MemoryError, a tracker bug) ends the
    forced drafts of its request, never the request; `failure` keeps it for the step
    loop to report."""

    __slots__ = ("_text", "_model", "_fed", "_tokenized", "failure", "_prompt", "_copy",
                 "_forcing", "_copying", "_guessing", "values")

    def __init__(self, shape: Shape, model: Model, prompt: list[int]) -> None:
        self._text = ForcedText(shape)
        self._model = model
        self._prompt = prompt
        self._copy: PromptCopy | None = None  # made for the first string value
        # A model that writes the forced text its own way (spacing, word cuts) gets short
        # forced drafts, or none for a while; copies that keep failing likewise.
        self._forcing = Backoff(MAX_FORCED, MAX_FORCED, slack=2, first_pause=2)
        self._copying = Backoff(4, MAX_COPY, slack=1, first_pause=4)
        # The n-gram drafter's guesses of what follows a forced text (a value from an
        # earlier document) fare otherwise than its drafts of free text: apart.
        self._guessing = Backoff(4, MAX_FORCED, slack=1, first_pause=4)
        # A guess stops before the `values`-th value the model chooses, as rows past a refused
        # token are wasted; drafts accepted whole double it (docs/performance/forced-drafts.md).
        self.values = _VALUES + 1
        self._fed = 0  # emitted tokens the text has read
        self._tokenized: dict[bytes, list[int]] = {}
        self.failure: BaseException | None = None

    def propose(self, emitted: list[int], room: int) -> list[int]:
        """The tokens of the text forced after `emitted` (every token the grammar has
        accepted), at most `room` of them; [] when the next token is the model's."""
        if room <= 0 or self.failure is not None:
            return []
        try:
            return self._propose(emitted, room)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return []

    def copy(self, emitted: list[int], room: int) -> tuple[list[int], list[int]]:
        """Inside a string value: the prompt's tokens after the text the value copies
        so far (copying.py), cut where the document would refuse them; and where the
        copy ends a phrase, the closing quote and the text forced after it. At most
        `room` tokens together; ([], []) elsewhere."""
        if room <= 0 or self.failure is not None:
            return [], []
        try:
            return self._copied(emitted, room)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return [], []

    def _copied(self, emitted: list[int], room: int) -> tuple[list[int], list[int]]:
        self._catch_up(emitted)
        value = self._text.string
        if self._copying.pause or value is None:
            return [], []
        if self._copy is None:
            self._copy = PromptCopy(self._prompt, self._model)
        copied, ends = self._copy.after(value, min(room, self._copying.limit))
        kept = self.fitting(emitted, copied)
        if kept < len(copied) or not ends or len(copied) >= room:
            return copied[:kept], []
        return copied, self._closing(copied, room - len(copied))

    def closed(self, emitted: list[int], guess: list[int],
               room: int) -> tuple[list[int], list[int]] | None:
        """Inside a string value, a guess of how it goes on (the n-gram drafter's) cut
        before its first token that ends a phrase, where the value likely ends, as a
        copy's does (copying.py); and the closing quote with the text forced after it,
        at most `room` tokens in all. None where the guess leaves the value first, or
        ends no phrase."""
        if not guess or self.failure is not None:
            return None
        try:
            self._catch_up(emitted)
            if self._text.string is None:
                return None
            pieces = self._pieces(guess)
            for index, piece in enumerate(pieces):
                if b'"' in piece or b"\n" in piece:
                    return None
                if ends_phrase(pieces, index, False):
                    kept = guess[:min(index, room)]
                    closing = self._closing(kept, room - len(kept))
                    return (kept, closing) if closing else None
            return None
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return None

    def _closing(self, value_rest: list[int], room: int) -> list[int]:
        """The closing quote and the text forced after it, once `value_rest` ends the
        string value; [] where the document refuses the quote or punctuation is the
        model's choice right after it."""
        if room <= 0:
            return []
        limit = _BYTES_PER_TOKEN * room
        after = self._text.text_after(b"".join(self._pieces(value_rest)) + b'"', limit)
        if not after:
            return []
        return self._drafted(after, len(after) >= limit, b'"')[:room]

    def after(self, emitted: list[int], guess: list[int], room: int) -> list[int]:
        """The tokens of the text forced once `guess` (a draft the document takes)
        follows `emitted`, at most `room`: a guess that closes a string value goes on
        through the `", "key": "` after it. [] where nothing is forced there, or the
        guess ends inside a word the forced text goes on with."""
        if room <= 0 or not guess or self.failure is not None:
            return []
        try:
            self._catch_up(emitted)
            text = self._text
            if text.lost or self._forcing.pause:
                return []
            data = b"".join(self._pieces(guess))
            limit = _BYTES_PER_TOKEN * room
            forced = text.text_after(data, limit)
            if not forced or (_is_word(data[-1]) and _is_word(forced[0])):
                return []  # see _propose
            return self._drafted(forced, len(forced) >= limit)[:min(room, self._forcing.limit)]
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return []

    @property
    def guessing(self) -> int:
        """How many tokens of a guess to draft after a forced text (0: none for now)."""
        return 0 if self._guessing.pause else self._guessing.limit

    def verified(self, forced: tuple[int, int], copied: tuple[int, int],
                 guessed: tuple[int, int] = (0, 0), *, whole: bool = False) -> None:
        """How many of a draft's forced tokens, of its copied ones and of the guess
        after its forced text were accepted, each (drafted, accepted), and whether the
        whole draft was: adapts the next ones."""
        self.values = min(2 * self.values, _MAX_VALUES) if whole else _VALUES
        if forced[0]:
            self._forcing.verified(*forced)
        if copied[0]:
            self._copying.verified(*copied)
        if guessed[0]:
            self._guessing.verified(*guessed)

    def fitting(self, emitted: list[int], tokens: list[int], values: int = 0) -> int:
        """How many of `tokens` (a guess of what follows `emitted`) the document can
        take: a guess is cut at the first token the grammar would refuse, and after
        the token that completes the document; given `values`, also at the token that
        holds the first byte of the `values`-th value it guesses after forced text
        (ForcedText.fits)."""
        if not tokens or self.failure is not None:
            return 0
        try:
            self._catch_up(emitted)
            text = self._text
            if text.lost:
                return len(tokens)  # nothing to check against
            pieces = self._pieces(tokens)
            data = b"".join(pieces)
            room = text.fits(data, values)
            for count, piece in enumerate(pieces):
                room -= len(piece)
                if room < 0:
                    return count
            return len(tokens)
        except Exception as exc:  # drafts are an optimisation (see class)
            self.failure = exc
            return 0

    def _pieces(self, tokens: list[int]) -> list[bytes]:
        """The tokens' bytes (the model's cache first; decode thread)."""
        model = self._model
        cached = model.pieces
        return [cached.get(token) or model.piece(token) for token in tokens]

    def _catch_up(self, emitted: list[int]) -> None:
        if self._fed < len(emitted):
            fresh = emitted[self._fed:]
            self._forcing.passed(len(fresh))
            self._copying.passed(len(fresh))
            self._guessing.passed(len(fresh))
            self._text.feed(b"".join(self._pieces(fresh)))
            self._fed = len(emitted)

    def _propose(self, emitted: list[int], room: int) -> list[int]:
        self._catch_up(emitted)
        text = self._text
        if text.lost or self._forcing.pause:
            return []
        limit = _BYTES_PER_TOKEN * room
        forced = text.text(limit)
        if not forced or (_is_word(text.last) and _is_word(forced[0])):
            # Inside a word the model cut its own way (`sent`, forced `iment`) it cuts the
            # rest its own way too (docs/performance/forced-drafts.md): no draft till it ends.
            return []
        return self._drafted(forced, len(forced) >= limit)[:min(room, self._forcing.limit)]

    def _drafted(self, forced: bytes, cut: bool, lead: bytes = b"") -> list[int]:
        """The tokens of `lead` + `forced` (a text ForcedText just gave, `cut` at its
        bound) as a draft: without the last one where the text may end inside it, or
        the model writes it merged with the punctuation it chooses next
        (ForcedText.before_choice)."""
        tokens = self._tokens(lead + forced)
        return tokens[:-1] if cut or self._text.before_choice else tokens

    def _tokens(self, forced: bytes) -> list[int]:
        """The model's tokenization of `forced`; [] when its pieces do not give the
        bytes back (a text the tokenizer would normalise)."""
        tokens = self._tokenized.get(forced)
        if tokens is not None:
            return tokens
        tokens = self._model.tokenize_bytes(forced)
        if b"".join(self._pieces(tokens)) != forced:
            tokens = []
        if len(self._tokenized) >= _TOKENIZED:
            self._tokenized.clear()
        self._tokenized[forced] = tokens
        return tokens


class Backoff:
    """How long one kind of draft may be and how many tokens it waits, as the n-gram
    drafter adapts its own (engine/speculative.py): the length doubles while drafts are
    accepted whole (up to `most`); after one accepted in part it is what was accepted
    plus `slack`; a draft refused at its first token pauses them for `first_pause`
    tokens, twice as many each further time in a row (up to _MAX_PAUSE)."""

    __slots__ = ("limit", "pause", "_most", "_slack", "_first_pause", "_next_pause")

    def __init__(self, limit: int, most: int, *, slack: int, first_pause: int) -> None:
        self.limit = limit
        self.pause = 0  # tokens to go before the next draft
        self._most = most
        self._slack = slack
        self._first_pause = self._next_pause = first_pause

    def verified(self, drafted: int, accepted: int) -> None:
        if accepted >= drafted:
            self.limit = min(2 * self.limit, self._most)
            self._next_pause = self._first_pause
            return
        self.limit = max(accepted + self._slack, 2)
        if accepted == 0:
            self.pause = self._next_pause
            self._next_pause = min(2 * self._next_pause, _MAX_PAUSE)

    def passed(self, tokens: int) -> None:
        """`tokens` more were emitted."""
        self.pause = max(self.pause - tokens, 0)
