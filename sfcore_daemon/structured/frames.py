"""The frames of a JSON document's scalar values, and the protocol every frame follows.

A frame is one open value of the document as tracker.py follows it: it reads the
document byte by byte (`feed`), knows the shortest bytes that end it (`rest`, for
closing a document within its budget, closer.py) and which bytes it allows next
(`nexts`, for the text a grammar forces, forced.py). The containers (objects, arrays)
and the reading of a whole document are tracker.py's; the scalar values are here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Self

from sfcore_daemon.structured.shape import shortest_integer

if TYPE_CHECKING:
    from sfcore_daemon.structured.shape import Shape

WS: Final = frozenset(b" \t\n\r")
DIGITS: Final = frozenset(b"0123456789")

# A frame's feed: kept going; finished (byte consumed); finished, the parent reads the
# byte; not allowed; opened a child (consumed); opened a child that reads the byte.
KEEP, DONE, PASS, FAIL, PUSH, PUSHBACK = range(6)

SPACE: Final = 0x20
# In a set of next bytes: any of many others (a number's first digit, say).
ANY_BYTE: Final = 256
# What a frame allows next: the bytes (SPACE for optional space), or None when too many to
# force anything; and whether it may end here, allowing its parent's next bytes too.
Nexts = tuple[frozenset[int] | None, bool]
UNFORCED: Final[Nexts] = (None, False)
QUOTE: Final[Nexts] = (frozenset(b'"'), False)


class Frame:
    __slots__ = ()

    def clone(self) -> Self:
        """A copy, quicker than copy.copy, which goes through __reduce_ex__; the
        fields are never mutated in place, so a shallow copy is a full one."""
        twin = object.__new__(type(self))
        name: str
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        raise NotImplementedError

    def child_done(self) -> None:
        """The child this frame opened has ended."""

    def rest(self) -> bytes | None:
        """The shortest bytes that end this frame, its open child taken as ended."""
        raise NotImplementedError

    def nexts(self) -> Nexts:
        """The bytes this frame allows next (see Nexts); a frame with an open child is
        never asked."""
        return UNFORCED

    def in_text(self) -> bool:
        """Whether the next byte is text of a value or key (not punctuation)."""
        return False

    def in_string(self) -> bool:
        """Whether the next byte is inside a string value of the model's choosing."""
        return False


# String states.
_S_START, _S_IN, _S_ESCAPE, _S_SURROGATE = range(4)
# After a backslash: the schema grammar's escapes (json.gbnf's lack `/`), and the digits
# of a \u escape.
_ESCAPED: Final = frozenset(b'"\\/bfnrtu')
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_OCTAL: Final = frozenset(b"01234567")


class StringFrame(Frame):
    """A JSON string of at least `min_chars` characters (an escape counts as one)."""

    __slots__ = ("min_chars", "state", "count", "hex_left", "utf8")

    def __init__(self, min_chars: int, opened: bool = False) -> None:
        self.min_chars = min_chars
        self.state = _S_IN if opened else _S_START
        self.count = 0
        self.hex_left = 0  # hex digits still due in a \u escape
        self.utf8 = b""  # a character's UTF-8 bytes so far, while it is incomplete

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        state = self.state
        if state == _S_START:
            if byte == ord('"'):
                self.state = _S_IN
                return KEEP, None
            return FAIL, None
        if self.hex_left:
            # \uD800-\uDFFF (half a surrogate pair) is refused, as the grammar does.
            if byte not in _HEX or (state == _S_SURROGATE and byte not in _OCTAL):
                return FAIL, None
            self.hex_left -= 1
            self.state = _S_SURROGATE if self.hex_left == 3 and byte in b"dD" else _S_IN
            return KEEP, None
        if state == _S_ESCAPE:
            if byte not in _ESCAPED:
                return FAIL, None
            self.state = _S_IN
            if byte == ord("u"):
                self.hex_left = 4
            return KEEP, None
        if self.utf8:
            self.utf8 = b"" if len(self.utf8) + 1 == utf8_length(self.utf8[0]) \
                else self.utf8 + bytes((byte,))
            return KEEP, None
        if byte == ord('"'):
            return DONE, None
        if byte < 0x20 or byte == 0x7F:  # the grammar's `char` has them escaped only
            return FAIL, None
        self.count += 1
        if byte == ord("\\"):
            self.state = _S_ESCAPE
        elif byte >= 0xC0:
            self.utf8 = bytes((byte,))
        return KEEP, None

    def rest(self) -> bytes:
        if self.state == _S_START:
            return b'"' + b"a" * self.min_chars + b'"'
        text = b""
        if self.state == _S_ESCAPE:
            text = b"\\"  # the escape becomes an escaped backslash
        elif self.hex_left:
            text = b"0" * self.hex_left
        elif self.utf8:
            text = _finish_utf8(self.utf8)
        return text + b"a" * max(0, self.min_chars - self.count) + b'"'

    def nexts(self) -> Nexts:
        return QUOTE if self.state == _S_START else UNFORCED

    def in_text(self) -> bool:
        return self.state != _S_START

    def in_string(self) -> bool:
        return self.state != _S_START


def utf8_length(lead: int) -> int:
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def _finish_utf8(started: bytes) -> bytes:
    """Continuation bytes that make a valid character of an incomplete one."""
    due = utf8_length(started[0]) - len(started)
    if len(started) == 1:
        second = {0xE0: 0xA0, 0xF0: 0x90}.get(started[0], 0x80)
        return bytes((second,)) + b"\x80" * (due - 1)
    return b"\x80" * due


class LiteralFrame(Frame):
    """One of a few fixed texts: enum and const values, true, false, null."""

    __slots__ = ("alive", "pos")

    def __init__(self, literals: list[bytes]) -> None:
        self.alive = literals
        self.pos = 0

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        pos = self.pos
        alive = [text for text in self.alive if len(text) > pos and text[pos] == byte]
        if alive:
            self.alive = alive
            self.pos = pos + 1
            return KEEP, None
        if any(len(text) == pos for text in self.alive):
            return PASS, None
        return FAIL, None

    def rest(self) -> bytes:
        return min((text[self.pos:] for text in self.alive), key=len)

    def nexts(self) -> Nexts:
        pos = self.pos
        return (frozenset(text[pos] for text in self.alive if len(text) > pos),
                any(len(text) == pos for text in self.alive))

    def in_text(self) -> bool:
        return self.pos > 0


class NumberFrame(Frame):
    __slots__ = ("integer", "low", "high", "text")

    def __init__(self, integer: bool, low: int | None, high: int | None) -> None:
        self.integer = integer
        self.low = low
        self.high = high
        self.text = b""

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        text = self.text
        last = text[-1:]
        if byte in DIGITS:
            # No digit after a leading zero ("-"? ([0-9] | [1-9] [0-9]...) in both grammars
            # the tracker serves), nor a third one in an exponent (gbnf.py's number).
            exponent = text.lower().partition(b"e")
            ok = (len(exponent[2].lstrip(b"-+")) < 2 if exponent[1]
                  else text.lstrip(b"-") != b"0")
        elif byte == ord("-"):
            ok = not text or (not self.integer and last in (b"e", b"E"))
        elif byte == ord("+"):
            ok = not self.integer and last in (b"e", b"E")
        elif byte == ord("."):
            ok = not self.integer and last.isdigit() and b"." not in text and b"e" not in \
                text.lower()
        elif byte in b"eE":
            ok = not self.integer and last.isdigit() and b"e" not in text.lower()
        else:
            ok = False
        if ok:
            self.text = text + bytes((byte,))
            return KEEP, None
        return (PASS if self.rest() == b"" else FAIL), None

    def rest(self) -> bytes | None:
        if self.integer:
            return shortest_integer(self.text, self.low, self.high)
        return b"0" if self.text[-1:] in (b"", b"-", b"+", b".", b"e", b"E") else b""


class PatternFrame(Frame):
    """A string matching a `pattern` (or a `format`), followed through its NFA."""

    __slots__ = ("nfa", "states", "opened", "utf8")

    def __init__(self, shape: Shape) -> None:
        assert shape.nfa is not None
        self.nfa = shape.nfa
        self.states = shape.nfa.start
        self.opened = False
        self.utf8 = b""

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        if not self.opened:
            self.opened = byte == ord('"')
            return (KEEP if self.opened else FAIL), None
        if byte == ord('"') and not self.utf8:
            return (DONE if self.nfa.accept in self.states else FAIL), None
        utf8 = self.utf8 + bytes((byte,))
        if byte >= 0x80 and len(utf8) < utf8_length(utf8[0]):
            self.utf8 = utf8
            return KEEP, None
        self.utf8 = b""
        self.states = self.nfa.step(self.states, ord(utf8.decode("utf-8", "replace")[0]))
        return (KEEP if self.states else FAIL), None

    def rest(self) -> bytes | None:
        if not self.opened:
            tail = self.nfa.shortest(self.nfa.start)
            return None if tail is None else b'"' + tail + b'"'
        if self.utf8:
            return None  # mid-character: no completion until the character is whole
        tail = self.nfa.shortest(self.states)
        return None if tail is None else tail + b'"'

    def nexts(self) -> Nexts:
        if not self.opened:
            return QUOTE
        # A value the pattern cannot lengthen (a date's day written) is closed next.
        nfa, states = self.nfa, self.states
        if not self.utf8 and nfa.accept in states and not any(nfa.edges[state] for state in states):
            return QUOTE
        return UNFORCED

    def in_text(self) -> bool:
        return self.opened

    def in_string(self) -> bool:
        return self.opened


Stack = list[Frame]

