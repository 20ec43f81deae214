"""Where a JSON document stands, and the shortest text that completes it.

`JsonTracker` reads the bytes a constrained generation has produced, as the grammar made
from its schema (or `format: "json"`) sees them, and keeps a small stack per reading: an
object waiting for a key, a string so many characters long, an array that needs two
more items. `completions()` gives the shortest bytes that make the document whole from
there: the string's closing quote (after the characters minLength still asks for), the
required properties not yet written with their shortest values (in the order the
schema's grammar requires), closing brackets. An `anyOf` whose alternatives agree on
the text so far keeps one stack for each (at most MAX_READINGS).

Pure Python and cheap per byte. Two readers: closer.py, once a request's budget is
close to its end, and forced.py, which follows a speculating request's document from
its start to draft the bytes every reading allows alone (`nexts`).
"""

from __future__ import annotations

from typing import Final

from sfcore_daemon.structured.frames import (
    ANY_BYTE,
    DIGITS,
    DONE,
    FAIL,
    KEEP,
    PASS,
    PUSH,
    PUSHBACK,
    SPACE,
    UNFORCED,
    WS,
    Frame,
    LiteralFrame,
    Nexts,
    NumberFrame,
    PatternFrame,
    StringFrame,
)
from sfcore_daemon.structured.shape import Shape, kvs

MAX_READINGS: Final = 8


class _Root(Frame):
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        return (KEEP if byte in WS else FAIL), None

    def child_done(self) -> None:
        self.done = True

    def rest(self) -> bytes:
        return b""


class _ValueStart(Frame):
    """A value of `shape` comes next; the tracker replaces this frame by the frame of
    each alternative the value's first byte allows."""

    __slots__ = ("shape",)

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def rest(self) -> bytes:
        return self.shape.shortest

    def nexts(self) -> Nexts:
        starts = first_bytes(self.shape)
        return (_SPACE_ANY if starts is None else starts | _SPACE_ONLY), False


def _frames_for(shape: Shape, byte: int) -> list[Frame]:
    kind = shape.kind
    if kind == "alt":
        return [frame for alt in shape.alts for frame in _frames_for(alt, byte)]
    if kind == "any":
        if byte == ord("{"):
            return [_Object(_free_object_any())]
        if byte == ord("["):
            return [_Array(_ANY_ARRAY)]
        if byte == ord('"'):
            return [StringFrame(0)]
        if byte in DIGITS or byte == ord("-"):
            return [NumberFrame(False, None, None)]
        return [LiteralFrame([b"true", b"false", b"null"])]
    if kind == "object":
        return [_Object(shape)] if byte == ord("{") else []
    if kind == "array":
        return [_Array(shape)] if byte == ord("[") else []
    if kind == "string":
        return [StringFrame(shape.min)] if byte == ord('"') else []
    if kind == "pattern":
        return [PatternFrame(shape)] if byte == ord('"') else []
    if kind == "literal":
        return [LiteralFrame(shape.literals)]
    if kind in ("number", "integer") and (byte in DIGITS or byte == ord("-")):
        return [NumberFrame(kind == "integer", shape.low, shape.high)]
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


class _Object(Frame):
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

    def _more_keys(self) -> bool:
        """Whether another key may come: a required one, an optional one after the last
        written, or any (additionalProperties)."""
        shape = self.shape
        return (self.n_required < len(shape.required) or shape.extra is not None
                or self.last_optional + 1 < len(shape.optional))

    def _value_shape(self) -> Shape:
        shape = self.shape
        if shape.extra is not None:
            return shape.extra
        return shape.props[self.key]

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        state = self.state
        if state == _O_START:
            if byte == ord("{"):
                self.state = _O_OPEN
                return KEEP, None
            return FAIL, None
        if state == _O_KEY:
            key = self.key + bytes((byte,))
            allowed = self._allowed()
            if not any(name.startswith(key) for name in allowed):
                return FAIL, None
            self.key = key
            if key in allowed:
                shape = self.shape
                if self.n_required < len(shape.required):
                    self.n_required += 1
                else:
                    self.last_optional = shape.optional.index(key)
                self.state = _O_COLON
            return KEEP, None
        if byte in WS:
            return KEEP, None
        if state in (_O_OPEN, _O_COMMA) and byte == ord('"'):
            if self.shape.extra is not None:
                self.state = _O_KEYSTR
                return PUSH, StringFrame(0, opened=True)
            self.key = b'"'
            self.state = _O_KEY
            return KEEP, None
        if state == _O_COLON and byte == ord(":"):
            self.state = _O_VALUE
            return PUSH, _ValueStart(self._value_shape())
        if state == _O_AFTER and byte == ord(","):
            if not self._more_keys():
                # The grammar has no key left to follow it: refusing the comma here
                # cuts a draft at its first refused byte, not at the key's first letter.
                return FAIL, None
            self.state = _O_COMMA
            return KEEP, None
        if state in (_O_OPEN, _O_AFTER) and byte == ord("}"):
            missing = self.n_required < len(self.shape.required)
            return (FAIL if missing else DONE), None
        return FAIL, None

    def child_done(self) -> None:
        self.state = _O_COLON if self.state == _O_KEYSTR else _O_AFTER

    def nexts(self) -> Nexts:
        state, shape = self.state, self.shape
        if state == _O_START:
            return _OPEN_BRACE
        if state == _O_KEY:
            at, key = len(self.key), self.key
            return frozenset(name[at] for name in self._allowed() if name.startswith(key)), False
        if state == _O_COLON:
            return _COLON
        if state == _O_COMMA:
            return _KEY_START
        if state not in (_O_OPEN, _O_AFTER):
            return UNFORCED
        missing = self.n_required < len(shape.required)
        allowed = {SPACE}
        if self._more_keys():
            allowed.add(ord('"') if state == _O_OPEN else ord(","))
        if not missing:
            allowed.add(ord("}"))
        return frozenset(allowed), False

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


class _Array(Frame):
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

    def _more_items(self) -> bool:
        """Whether another item may follow the `count` begun (maxItems, prefixItems)."""
        count = self.count
        return (self.shape.max is None or count < self.shape.max) and self._item(count) is not None

    def _needed(self) -> int:
        shape = self.shape
        return len(shape.prefix) if shape.prefix is not None else shape.min

    def feed(self, byte: int) -> tuple[int, Frame | None]:
        state = self.state
        if state == _A_START:
            if byte == ord("["):
                self.state = _A_OPEN
                return KEEP, None
            return FAIL, None
        if byte in WS:
            return KEEP, None
        if state in (_A_OPEN, _A_AFTER) and byte == ord("]"):
            return (DONE if self.count >= self._needed() else FAIL), None
        if state == _A_AFTER:
            if byte == ord(",") and self._more_items():
                self.state = _A_COMMA
                return KEEP, None
            return FAIL, None
        item = self._item(self.count)
        if item is None:
            return FAIL, None
        self.count += 1
        self.state = _A_VALUE
        return PUSHBACK, _ValueStart(item)

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

    def nexts(self) -> Nexts:
        state, count = self.state, self.count
        if state == _A_START:
            return _OPEN_BRACKET
        if state == _A_AFTER:
            allowed = {SPACE}
            if self._more_items():
                allowed.add(ord(","))
            if count >= self._needed():
                allowed.add(ord("]"))
            return frozenset(allowed), False
        item = self._item(count)
        if state == _A_OPEN and (item is None or self.shape.max == 0):
            return _EMPTY_ARRAY
        starts = None if item is None else first_bytes(item)
        if starts is None:
            return UNFORCED
        if state == _A_OPEN and self._needed() == 0:
            return starts | _CLOSE_BRACKET, False
        return starts | _SPACE_ONLY, False


Stack = list[Frame]

_SPACE_ONLY: Final = frozenset((SPACE,))
_SPACE_ANY: Final = frozenset((SPACE, ANY_BYTE))
_CLOSE_BRACKET: Final = frozenset(b" ]")
_OPEN_BRACKET: Final[Nexts] = (frozenset(b"["), False)
_OPEN_BRACE: Final[Nexts] = (frozenset(b"{"), False)
_COLON: Final[Nexts] = (frozenset(b" :"), False)
_KEY_START: Final[Nexts] = (frozenset(b' "'), False)
_EMPTY_ARRAY: Final[Nexts] = (_CLOSE_BRACKET, False)


def first_bytes(shape: Shape, depth: int = 0) -> frozenset[int] | None:
    """The bytes a value of `shape` may start with; None when they are too many to force
    anything (a number, any value), or a chain of $refs runs too deep."""
    kind = shape.kind
    if kind == "object":
        return _BRACE
    if kind == "array":
        return _BRACKET
    if kind in ("string", "pattern"):
        return _QUOTE
    if kind == "literal":
        return frozenset(literal[0] for literal in shape.literals if literal)
    if kind != "alt" or depth > _MAX_REF_DEPTH:
        return None
    found: set[int] = set()
    for alt in shape.alts:
        starts = first_bytes(alt, depth + 1)
        if starts is None:
            return None
        found |= starts
    return frozenset(found)


_BRACE: Final = frozenset(b"{")
_BRACKET: Final = frozenset(b"[")
_QUOTE: Final = frozenset(b'"')
_MAX_REF_DEPTH: Final = 32


def _step(stack: Stack, byte: int) -> list[Stack]:
    top = stack[-1]
    if type(top) is _ValueStart:
        if byte in WS:
            return [stack]
        readings: list[Stack] = []
        for index, frame in enumerate(_frames_for(top.shape, byte)):
            base = stack[:-1] if index == 0 else [f.clone() for f in stack[:-1]]
            base.append(frame)
            readings.extend(_step(base, byte))
        return readings
    code, child = top.feed(byte)
    if code == KEEP:
        return [stack]
    if code == FAIL:
        return []
    if code in (PUSH, PUSHBACK):
        assert child is not None
        stack.append(child)
        return [stack] if code == PUSH else _step(stack, byte)
    stack.pop()
    stack[-1].child_done()
    return _step(stack, byte) if code == PASS else [stack]


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

    def nexts(self) -> frozenset[int] | None:
        """The bytes the document allows next over every reading: SPACE where the
        grammar's optional space may come, ANY_BYTE where a value may start with
        too many bytes to force one. None when the text is lost or a reading is inside
        a free value (a string's characters, a number's digits)."""
        if not self.readings:
            return None
        allowed: set[int] = set()
        for stack in self.readings:
            depth = len(stack) - 1
            frame = stack[depth]
            while True:
                found, may_end = frame.nexts()
                if found is None:
                    return None
                allowed |= found
                if not may_end or depth == 0:
                    break
                # The frame may end here: what its parent allows then is allowed too.
                depth -= 1
                frame = stack[depth].clone()
                frame.child_done()
        return frozenset(allowed)

    @property
    def whole(self) -> bool:
        """The document is complete in some reading (only whitespace may follow)."""
        return any(len(stack) == 1 for stack in self.readings)

    def in_text(self) -> bool:
        """Whether the next byte would be inside a string, a key or an enum value, where
        it is text and not the document's punctuation (the first reading's view)."""
        return bool(self.readings) and self.readings[0][-1].in_text()

    def in_string(self) -> bool:
        """Whether the next byte would be inside a string value (the first reading's
        view): text of the model's choosing, often copied from the prompt."""
        return bool(self.readings) and self.readings[0][-1].in_string()

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
