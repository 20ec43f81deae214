"""Where a JSON document stands, and the shortest text that completes it.

`JsonTracker` reads the bytes a constrained generation has produced, as the grammar made
from its schema (or `format: "json"`) sees them, and keeps a small stack per reading: an
object waiting for a key, a string so many characters long, an array that needs two
more items. `completions()` gives the shortest bytes that make the document whole from
there: the string's closing quote (after the characters minLength still asks for), the
required properties not yet written with their shortest values (in the order the
schema's grammar requires), closing brackets. An `anyOf` whose alternatives agree on
the text so far keeps one stack for each (at most MAX_READINGS).

Pure Python and cheap per byte, but nothing reads it on the fast path: grammar.py feeds
it only once a request's budget is close to its end (closer.py).
"""

from __future__ import annotations

from typing import Final, Self

from sfcore_daemon.structured.shape import Shape, kvs, shortest_integer

MAX_READINGS: Final = 8
_WS: Final = frozenset(b" \t\n\r")
_DIGITS: Final = frozenset(b"0123456789")

# What a frame's feed returns: the byte kept it going; finished it (consumed);
# finished it without being consumed (the parent reads it next); is not allowed here;
# opened a child (consumed); opened a child that reads this byte itself.
_KEEP, _DONE, _PASS, _FAIL, _PUSH, _PUSHBACK = range(6)


class _Frame:
    __slots__ = ()

    def clone(self) -> Self:
        """A copy (4x quicker than copy.copy, which goes through __reduce_ex__); the
        fields are never mutated in place, so a shallow copy is a full one."""
        twin = object.__new__(type(self))
        name: str
        for name in self.__slots__:
            setattr(twin, name, getattr(self, name))
        return twin

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        raise NotImplementedError

    def child_done(self) -> None:
        """The child this frame opened has ended."""

    def rest(self) -> bytes | None:
        """The shortest bytes that end this frame, its open child taken as ended."""
        raise NotImplementedError


class _Root(_Frame):
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        return (_KEEP if byte in _WS else _FAIL), None

    def child_done(self) -> None:
        self.done = True

    def rest(self) -> bytes:
        return b""


class _ValueStart(_Frame):
    """A value of `shape` comes next; the tracker replaces this frame by the frame of
    each alternative the value's first byte allows."""

    __slots__ = ("shape",)

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def rest(self) -> bytes:
        return self.shape.shortest


def _frames_for(shape: Shape, byte: int) -> list[_Frame]:
    kind = shape.kind
    if kind == "alt":
        return [frame for alt in shape.alts for frame in _frames_for(alt, byte)]
    if kind == "any":
        if byte == ord("{"):
            return [_Object(_free_object_any())]
        if byte == ord("["):
            return [_Array(_ANY_ARRAY)]
        if byte == ord('"'):
            return [_String(0)]
        if byte in _DIGITS or byte == ord("-"):
            return [_Number(False, None, None)]
        return [_Literal([b"true", b"false", b"null"])]
    if kind == "object":
        return [_Object(shape)] if byte == ord("{") else []
    if kind == "array":
        return [_Array(shape)] if byte == ord("[") else []
    if kind == "string":
        return [_String(shape.min)] if byte == ord('"') else []
    if kind == "pattern":
        return [_Pattern(shape)] if byte == ord('"') else []
    if kind == "literal":
        return [_Literal(shape.literals)]
    if kind in ("number", "integer") and (byte in _DIGITS or byte == ord("-")):
        return [_Number(kind == "integer", shape.low, shape.high)]
    return []  # untracked: this reading ends


def _free_object_any() -> Shape:
    from sfcore_daemon.structured.shape import free_object
    return free_object()


def _any_array() -> Shape:
    from sfcore_daemon.structured.shape import any_shape
    shape = Shape("array")
    shape.items = any_shape()
    return shape


_ANY_ARRAY: Final = _any_array()

# Object states.
_O_START, _O_OPEN, _O_KEY, _O_COLON, _O_VALUE, _O_AFTER, _O_COMMA, _O_KEYSTR = range(8)


class _Object(_Frame):
    __slots__ = ("shape", "state", "key", "n_required", "last_optional")

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.state = _O_START
        self.key = b""  # the key literal being written, then the key written last
        self.n_required = 0  # required properties written (they come first, in order)
        self.last_optional = -1  # index in shape.optional of the last one written

    def _allowed(self) -> list[bytes]:
        shape = self.shape
        if self.n_required < len(shape.required):
            return [shape.required[self.n_required]]
        return shape.optional[self.last_optional + 1:]

    def _value_shape(self) -> Shape:
        shape = self.shape
        if shape.extra is not None:
            return shape.extra
        return shape.props[self.key]

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        state = self.state
        if state == _O_START:
            if byte == ord("{"):
                self.state = _O_OPEN
                return _KEEP, None
            return _FAIL, None
        if state == _O_KEY:
            key = self.key + bytes((byte,))
            allowed = self._allowed()
            if not any(name.startswith(key) for name in allowed):
                return _FAIL, None
            self.key = key
            if key in allowed:
                shape = self.shape
                if self.n_required < len(shape.required):
                    self.n_required += 1
                else:
                    self.last_optional = shape.optional.index(key)
                self.state = _O_COLON
            return _KEEP, None
        if byte in _WS:
            return _KEEP, None
        if state in (_O_OPEN, _O_COMMA) and byte == ord('"'):
            if self.shape.extra is not None:
                self.state = _O_KEYSTR
                return _PUSH, _String(0, opened=True)
            self.key = b'"'
            self.state = _O_KEY
            return _KEEP, None
        if state == _O_COLON and byte == ord(":"):
            self.state = _O_VALUE
            return _PUSH, _ValueStart(self._value_shape())
        if state == _O_AFTER and byte == ord(","):
            self.state = _O_COMMA
            return _KEEP, None
        if state in (_O_OPEN, _O_AFTER) and byte == ord("}"):
            missing = self.n_required < len(self.shape.required)
            return (_FAIL if missing else _DONE), None
        return _FAIL, None

    def child_done(self) -> None:
        self.state = _O_COLON if self.state == _O_KEYSTR else _O_AFTER

    def _tail(self) -> bytes:
        """After a complete key-value pair: the required pairs still missing, then }."""
        shape = self.shape
        missing = shape.required[self.n_required:]
        return (b"," + kvs(shape, missing) if missing else b"") + b"}"

    def rest(self) -> bytes | None:
        state, shape = self.state, self.shape
        if state == _O_START:
            return shape.shortest
        if state == _O_KEYSTR:
            assert shape.extra is not None
            return b":" + shape.extra.shortest + b"}"
        if state in (_O_VALUE, _O_AFTER):
            return self._tail()
        if state == _O_COLON:
            return b":" + self._value_shape().shortest + self._tail()
        if state == _O_OPEN and (shape.extra is not None or not shape.required):
            return b"}"
        if state == _O_OPEN or (state == _O_COMMA and self.n_required < len(shape.required)):
            return kvs(shape, shape.required[self.n_required:]) + b"}"
        if state == _O_COMMA:  # a comma with every required pair written: one more pair
            if shape.extra is not None:
                return b'"":' + shape.extra.shortest + b"}"
            return min((kvs(shape, [key]) + b"}" for key in self._allowed()), key=len,
                       default=None)
        # _O_KEY: finish one of the keys the text so far can still become.
        best: bytes | None = None
        for key in self._allowed():
            if key.startswith(self.key):
                required_next = self.n_required < len(shape.required)
                after = shape.required[self.n_required + 1:] if required_next else []
                text = (key[len(self.key):] + b":" + shape.props[key].shortest
                        + (b"," + kvs(shape, after) if after else b"") + b"}")
                if best is None or len(text) < len(best):
                    best = text
        return best


# Array states.
_A_START, _A_OPEN, _A_VALUE, _A_AFTER, _A_COMMA = range(5)


class _Array(_Frame):
    __slots__ = ("shape", "state", "count")

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.state = _A_START
        self.count = 0  # items begun

    def _item(self, index: int) -> Shape | None:
        shape = self.shape
        if shape.prefix is not None:
            return shape.prefix[index] if index < len(shape.prefix) else None
        return shape.items

    def _needed(self) -> int:
        shape = self.shape
        return len(shape.prefix) if shape.prefix is not None else shape.min

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        state = self.state
        if state == _A_START:
            if byte == ord("["):
                self.state = _A_OPEN
                return _KEEP, None
            return _FAIL, None
        if byte in _WS:
            return _KEEP, None
        if state in (_A_OPEN, _A_AFTER) and byte == ord("]"):
            return (_DONE if self.count >= self._needed() else _FAIL), None
        if state == _A_AFTER:
            if byte == ord(","):
                self.state = _A_COMMA
                return _KEEP, None
            return _FAIL, None
        item = self._item(self.count)
        if item is None:
            return _FAIL, None
        self.count += 1
        self.state = _A_VALUE
        return _PUSHBACK, _ValueStart(item)

    def child_done(self) -> None:
        self.state = _A_AFTER

    def _items(self, start: int, end: int) -> bytes | None:
        shapes = [self._item(index) for index in range(start, end)]
        if any(shape is None for shape in shapes):
            return None
        return b",".join(shape.shortest for shape in shapes if shape is not None)

    def rest(self) -> bytes | None:
        state, needed, count = self.state, self._needed(), self.count
        if state == _A_START:
            return self.shape.shortest
        if state == _A_OPEN:
            items = self._items(0, needed)
            return None if items is None else items + b"]"
        if state == _A_COMMA:
            items = self._items(count, max(needed, count + 1))
            return None if items is None else items + b"]"
        if count >= needed:
            return b"]"
        items = self._items(count, needed)
        return None if items is None else b"," + items + b"]"


# String states.
_S_START, _S_IN, _S_ESCAPE = range(3)


class _String(_Frame):
    """A JSON string of at least `min_chars` characters (an escape counts as one)."""

    __slots__ = ("min_chars", "state", "count", "hex_left", "utf8")

    def __init__(self, min_chars: int, opened: bool = False) -> None:
        self.min_chars = min_chars
        self.state = _S_IN if opened else _S_START
        self.count = 0
        self.hex_left = 0  # hex digits still due in a \u escape
        self.utf8 = b""  # a character's UTF-8 bytes so far, while it is incomplete

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        state = self.state
        if state == _S_START:
            if byte == ord('"'):
                self.state = _S_IN
                return _KEEP, None
            return _FAIL, None
        if self.hex_left:
            self.hex_left -= 1
            return _KEEP, None
        if state == _S_ESCAPE:
            self.state = _S_IN
            if byte == ord("u"):
                self.hex_left = 4
            return _KEEP, None
        if self.utf8:
            self.utf8 = b"" if len(self.utf8) + 1 == _utf8_length(self.utf8[0]) \
                else self.utf8 + bytes((byte,))
            return _KEEP, None
        if byte == ord('"'):
            return _DONE, None
        self.count += 1
        if byte == ord("\\"):
            self.state = _S_ESCAPE
        elif byte >= 0xC0:
            self.utf8 = bytes((byte,))
        return _KEEP, None

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


def _utf8_length(lead: int) -> int:
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


def _finish_utf8(started: bytes) -> bytes:
    """Continuation bytes that make a valid character of an incomplete one."""
    due = _utf8_length(started[0]) - len(started)
    if len(started) == 1:
        second = {0xE0: 0xA0, 0xF0: 0x90}.get(started[0], 0x80)
        return bytes((second,)) + b"\x80" * (due - 1)
    return b"\x80" * due


class _Literal(_Frame):
    """One of a few fixed texts: enum and const values, true, false, null."""

    __slots__ = ("alive", "pos")

    def __init__(self, literals: list[bytes]) -> None:
        self.alive = literals
        self.pos = 0

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        pos = self.pos
        alive = [text for text in self.alive if len(text) > pos and text[pos] == byte]
        if alive:
            self.alive = alive
            self.pos = pos + 1
            return _KEEP, None
        if any(len(text) == pos for text in self.alive):
            return _PASS, None
        return _FAIL, None

    def rest(self) -> bytes:
        return min((text[self.pos:] for text in self.alive), key=len)


class _Number(_Frame):
    __slots__ = ("integer", "low", "high", "text")

    def __init__(self, integer: bool, low: int | None, high: int | None) -> None:
        self.integer = integer
        self.low = low
        self.high = high
        self.text = b""

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        text = self.text
        last = text[-1:]
        if byte in _DIGITS:
            ok = True
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
            return _KEEP, None
        return (_PASS if self.rest() == b"" else _FAIL), None

    def rest(self) -> bytes | None:
        if self.integer:
            return shortest_integer(self.text, self.low, self.high)
        return b"0" if self.text[-1:] in (b"", b"-", b"+", b".", b"e", b"E") else b""


class _Pattern(_Frame):
    """A string matching a `pattern` (or a `format`), followed through its NFA."""

    __slots__ = ("nfa", "states", "opened", "utf8")

    def __init__(self, shape: Shape) -> None:
        assert shape.nfa is not None
        self.nfa = shape.nfa
        self.states = shape.nfa.start
        self.opened = False
        self.utf8 = b""

    def feed(self, byte: int) -> tuple[int, _Frame | None]:
        if not self.opened:
            self.opened = byte == ord('"')
            return (_KEEP if self.opened else _FAIL), None
        if byte == ord('"') and not self.utf8:
            return (_DONE if self.nfa.accept in self.states else _FAIL), None
        utf8 = self.utf8 + bytes((byte,))
        if byte >= 0x80 and len(utf8) < _utf8_length(utf8[0]):
            self.utf8 = utf8
            return _KEEP, None
        self.utf8 = b""
        self.states = self.nfa.step(self.states, ord(utf8.decode("utf-8", "replace")[0]))
        return (_KEEP if self.states else _FAIL), None

    def rest(self) -> bytes | None:
        if not self.opened:
            tail = self.nfa.shortest(self.nfa.start)
            return None if tail is None else b'"' + tail + b'"'
        if self.utf8:
            return None  # mid-character: no completion until the character is whole
        tail = self.nfa.shortest(self.states)
        return None if tail is None else tail + b'"'


Stack = list[_Frame]


def _step(stack: Stack, byte: int) -> list[Stack]:
    top = stack[-1]
    if type(top) is _ValueStart:
        if byte in _WS:
            return [stack]
        readings: list[Stack] = []
        for index, frame in enumerate(_frames_for(top.shape, byte)):
            base = stack[:-1] if index == 0 else [f.clone() for f in stack[:-1]]
            base.append(frame)
            readings.extend(_step(base, byte))
        return readings
    code, child = top.feed(byte)
    if code == _KEEP:
        return [stack]
    if code == _FAIL:
        return []
    if code in (_PUSH, _PUSHBACK):
        assert child is not None
        stack.append(child)
        return [stack] if code == _PUSH else _step(stack, byte)
    stack.pop()
    stack[-1].child_done()
    return _step(stack, byte) if code == _PASS else [stack]


class JsonTracker:
    """The readings of a document so far, and how each can end soonest."""

    __slots__ = ("readings",)

    def __init__(self, shape: Shape) -> None:
        self.readings: list[Stack] = [[_Root(), _ValueStart(shape)]]

    @property
    def lost(self) -> bool:
        """No reading follows the text (a construct the tracker does not follow)."""
        return not self.readings

    def feed(self, data: bytes) -> None:
        readings = self.readings
        for byte in data:
            following: list[Stack] = []
            for stack in readings:
                following.extend(_step(stack, byte))
            readings = following[:MAX_READINGS]
            if not readings:
                break
        self.readings = readings

    def completions(self) -> list[bytes]:
        """The shortest completion of each reading, shortest first, without repeats
        (b"" when the document is whole)."""
        found: set[bytes] = set()
        for stack in self.readings:
            parts = [frame.rest() for frame in reversed(stack)]
            if all(part is not None for part in parts):
                found.add(b"".join(part for part in parts if part is not None))
        return sorted(found, key=lambda text: (len(text), text))

    def copy(self) -> JsonTracker:
        twin = JsonTracker.__new__(JsonTracker)
        twin.readings = [[frame.clone() for frame in stack] for stack in self.readings]
        return twin
