"""The one intermediate form of a JSON Schema: a tree of `Shape`s.

`shape_of(schema)` walks a schema that `checker.check_schema` accepted, once, into
`Shape`s. Everything downstream is derived from that tree: the GBNF text (gbnf.py writes
it from the shapes alone) and budget-aware closing (tracker.py and closer.py read the
shapes on the decode thread). A shape holds what both need: the order of object
properties (required ones first, in schema order, then the optional ones in order), the
literals of keys, `enum` and `const` as JSON writes them, string and array bounds,
integer bounds, a pattern's regular expression (and its NFA), and each `$ref` target
as one shared shape. `Shape.shortest` is the shortest text of a fresh value of that
shape, which closer.py uses to close a document in as few bytes as the grammar allows.

Pure Python, no llama.cpp: built on the event loop, read on the decode thread.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from typing import Any, Final

# The standard library's own regular expression parser, for the NFA of a `pattern`
# (sre_parse, its old name, warns when imported).
sre: Any = importlib.import_module("re._parser")

# NFA states over a schema's patterns; patterns past it are not tracked, so a document
# inside such a string when the budget runs out just ends ("length").
MAX_NFA_STATES: Final = 20000
# A shortest text this long stands for "too long to complete": a $ref cycle with no way
# out, an untracked pattern, or counts that multiply (an array of minItems arrays).
_INFINITE: Final = b"\xff" * 100000

# The string formats, as regular expressions over the characters: a format is a
# pattern (its NFA and its GBNF come from the same text).
_DATE: Final = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[1-2][0-9]|3[0-1])"
_TIME: Final = (r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{3})?"
                r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
FORMAT_PATTERNS: Final = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12)),
}


class Shape:
    """One schema's value. `kind` is one of: any, object, array, string, pattern,
    literal, number, integer, alt, untracked (a pattern past the NFA budget).

    An `alt` with a `ref` is the target of that $ref: one shape for every reference to
    it (a recursive schema is a cycle of shapes), its one alternative the target's shape.
    """

    __slots__ = ("kind", "props", "required", "optional", "extra", "items", "prefix",
                 "min", "max", "low", "high", "literals", "typed", "alts", "ref", "regex",
                 "nfa", "_shortest")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.props: dict[bytes, Shape] = {}  # object: key literal (quoted) -> value
        self.required: list[bytes] = []
        self.optional: list[bytes] = []
        self.extra: Shape | None = None  # object without properties: any key, this value
        self.items: Shape | None = None
        self.prefix: list[Shape] | None = None
        self.min = 0  # array items, string characters; integer bounds below
        self.max: int | None = None
        self.low: int | None = None  # an integer's inclusive bounds
        self.high: int | None = None
        self.literals: list[bytes] = []
        # The literals of the type boolean or null, which end like any other value (in
        # the grammar's optional space); an enum's or a const's literals stand bare.
        self.typed = False
        self.alts: list[Shape] = []
        self.ref: str | None = None
        self.regex = ""  # pattern, untracked: the regular expression, without ^ and $
        self.nfa: Nfa | None = None
        self._shortest: bytes | None = None

    @property
    def shortest(self) -> bytes:
        """The shortest text of a fresh value (memoised; a $ref cycle with no way out,
        or anything longer than _INFINITE, is "infinitely" long)."""
        cached = self._shortest
        if cached is None:
            self._shortest = _INFINITE  # while in progress: a cycle is no way out
            cached = self._compute_shortest()
            if len(cached) > len(_INFINITE):
                cached = _INFINITE
            self._shortest = cached
        return cached

    def _compute_shortest(self) -> bytes:
        kind = self.kind
        if kind == "any":
            return b"0"
        if kind == "object":
            return b"{" + kvs(self, self.required) + b"}"
        if kind == "array":
            if self.prefix is not None:
                return _joined(b"[", [item.shortest for item in self.prefix], b"]")
            assert self.items is not None
            item = self.items.shortest
            if len(item) * self.min > len(_INFINITE):
                return _INFINITE
            return b"[" + b",".join([item] * self.min) + b"]"
        if kind == "string":
            return b'"' + b"a" * self.min + b'"'
        if kind == "pattern":
            assert self.nfa is not None
            tail = self.nfa.shortest(self.nfa.start)
            return _INFINITE if tail is None else b'"' + tail + b'"'
        if kind == "literal":
            return min(self.literals, key=len)
        if kind == "integer":
            return shortest_integer(b"", self.low, self.high) or _INFINITE
        if kind == "number":
            return b"0"
        if kind == "untracked":
            return _INFINITE
        return min((alt.shortest for alt in self.alts), key=len)


def kvs(shape: Shape, keys: list[bytes]) -> bytes:
    """`"key":value` for each key, shortest values, comma-separated (_INFINITE as soon
    as they add up to more)."""
    return _joined(b"", (key + b":" + shape.props[key].shortest for key in keys), b"")


def _joined(opening: bytes, parts: Iterable[bytes], closing: bytes) -> bytes:
    """opening, the parts comma-separated, closing; _INFINITE once longer."""
    joined = []
    length = 0
    for part in parts:
        length += len(part) + 1
        if length > len(_INFINITE):
            return _INFINITE
        joined.append(part)
    return opening + b",".join(joined) + closing


def integer_shape(low: int | None, high: int | None) -> Shape:
    shape = Shape("integer")
    shape.low, shape.high = low, high
    return shape


def shortest_integer(prefix: bytes, low: int | None, high: int | None) -> bytes | None:
    """The fewest digits that make `prefix` + them an integer in [low, high] (None when
    none do): what the grammar of a bounded integer lets the document end with."""
    if not prefix:
        if (low is None or low <= 0) and (high is None or high >= 0):
            return b"0"
        return str(low if low is not None and low > 0 else high).encode()
    text = prefix.decode("ascii", errors="replace")
    negative = text.startswith("-")
    digits = text[1:] if negative else text
    if (digits.startswith("0") and len(digits) > 1) or (digits and not digits.isdigit()):
        return None
    if low is None and high is None:  # the plain rule: "-"? ([0-9] | [1-9] [0-9]{0,15})
        return b"" if digits else b"0"
    for extra in range(17 - len(digits)):
        if not digits and extra == 0:
            continue
        if digits == "0" and extra:
            break  # no digit may follow a leading zero
        if not digits and extra > 1:
            first, last = int("1" + "0" * (extra - 1)), int("9" * extra)
        elif not digits:
            first, last = (1 if negative else 0), 9
        else:
            first, last = int(digits + "0" * extra), int(digits + "9" * extra)
        values = (-last, -first) if negative else (first, last)
        lowest = max(values[0], low) if low is not None else values[0]
        highest = min(values[1], high) if high is not None else values[1]
        if lowest <= highest:
            if negative and lowest == 0 and highest >= 0:
                continue  # "-0" is not an integer the grammar writes
            value = highest if negative else lowest
            return str(value).encode()[len(prefix):]
    return None


# --- schemas to shapes ------------------------------------------------------------------


def any_shape() -> Shape:
    return Shape("any")


def free_object(value: Shape | None = None) -> Shape:
    shape = Shape("object")
    shape.extra = value if value is not None else any_shape()
    return shape


def shape_of(schema: dict[str, Any], refs: dict[str, dict[str, Any]] | None = None) -> Shape:
    """The shape of a checked schema (checker.py), references resolved lazily (they
    may recurse): through `refs` (the checked schema each $ref refers to), else by their
    path in `schema`."""
    return _Builder(schema, refs).visit(schema)


class _Builder:
    def __init__(self, root: dict[str, Any], refs: dict[str, dict[str, Any]] | None) -> None:
        self._root = root
        self._targets = refs
        self._refs: dict[str, Shape] = {}
        self._nfa_states = MAX_NFA_STATES  # left for the schema's patterns

    def visit(self, schema: dict[str, Any]) -> Shape:
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "anyOf" in schema:
            return self._alt([self.visit(sub) for sub in schema["anyOf"]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._alt([self.visit({"type": one}) for one in kind])
        if "const" in schema:
            return _literal([schema["const"]])
        if "enum" in schema:
            return _literal(schema["enum"])
        if kind in (None, "object") and ("properties" in schema or (
                "additionalProperties" in schema and schema["additionalProperties"] is not True)):
            return self._object(schema)
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            return self._array(schema)
        if kind in (None, "string") and "pattern" in schema:
            return self._pattern(schema["pattern"][1:-1])
        if kind in (None, "string") and schema.get("format") in FORMAT_PATTERNS:
            return self._pattern(FORMAT_PATTERNS[schema["format"]])
        if kind == "string":
            shape = Shape("string")
            shape.min, shape.max = schema.get("minLength", 0), schema.get("maxLength")
            return shape
        if kind == "object" or not schema:
            return free_object()
        if kind == "array":
            shape = Shape("array")
            shape.items = any_shape()
            return shape
        if kind == "integer":
            low, high = integer_bounds(schema)
            return integer_shape(low, high)
        if kind == "number":
            return Shape("number")
        shape = _literal([True, False] if kind == "boolean" else [None])
        shape.typed = True
        return shape

    def _ref(self, ref: str) -> Shape:
        shape = self._refs.get(ref)
        if shape is None:
            # A placeholder first: a recursive reference finds it and shares the result.
            shape = self._refs[ref] = Shape("alt")
            shape.ref = ref
            target: Any = self._root
            if self._targets is not None:
                target = self._targets[ref]
            else:
                for part in ref[2:].split("/"):
                    target = target[part]
            shape.alts = [self.visit(target)]
        return shape

    def _pattern(self, regex: str) -> Shape:
        shape = Shape("pattern")
        shape.regex = regex
        try:
            shape.nfa = Nfa.compile(regex, self._nfa_states)
            self._nfa_states -= len(shape.nfa.edges)
        except (ValueError, re_error):
            shape.nfa = None
            shape.kind = "untracked"
        return shape

    @staticmethod
    def _alt(alts: list[Shape]) -> Shape:
        shape = Shape("alt")
        shape.alts = alts
        return shape

    def _object(self, schema: dict[str, Any]) -> Shape:
        properties: dict[str, Any] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        if not properties and (extra is True or isinstance(extra, dict)):
            # `true` beside `"properties": {}` stands for the schema {}, which is any
            # object (as llama.cpp's converter read it: the grammar is unchanged).
            return free_object(self.visit(extra if isinstance(extra, dict) else {}))
        shape = Shape("object")
        required = set(schema.get("required", []))
        for name, sub in properties.items():
            key = json.dumps(name).encode()  # the key's literal: ASCII, escaped
            shape.props[key] = self.visit(sub)
            (shape.required if name in required else shape.optional).append(key)
        return shape

    def _array(self, schema: dict[str, Any]) -> Shape:
        shape = Shape("array")
        if "prefixItems" in schema:
            shape.prefix = [self.visit(sub) for sub in schema["prefixItems"]]
            return shape
        shape.items = self.visit(schema["items"])
        shape.min, shape.max = schema.get("minItems", 0), schema.get("maxItems")
        return shape


def integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The inclusive bounds of an integer schema's minimum/maximum keywords."""
    low: int | None = None
    high: int | None = None
    if "minimum" in schema:
        low = _ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        bound = _floor(schema["exclusiveMinimum"]) + 1
        low = bound if low is None else max(low, bound)
    if "maximum" in schema:
        high = _floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        bound = _ceil(schema["exclusiveMaximum"]) - 1
        high = bound if high is None else min(high, bound)
    return low, high


def _floor(value: float) -> int:
    return int(value) if value >= 0 or float(value).is_integer() else int(value) - 1


def _ceil(value: float) -> int:
    return -_floor(-value)


def _literal(values: list[Any]) -> Shape:
    shape = Shape("literal")
    # Non-ASCII text as itself rather than as \u escapes: the form a model writes.
    shape.literals = [json.dumps(value, ensure_ascii=False).encode() for value in values]
    return shape


re_error = sre.error if hasattr(sre, "error") else ValueError


# --- patterns ---------------------------------------------------------------------------


class Nfa:
    """A Thompson NFA over characters for the pattern subset pattern.py accepts."""

    __slots__ = ("accept", "edges", "eps", "limit", "start")

    def __init__(self, limit: int = MAX_NFA_STATES) -> None:
        self.limit = limit
        self.edges: list[list[tuple[int, int, int]]] = []  # (low, high, target)
        self.eps: list[list[int]] = []
        self.start: frozenset[int] = frozenset()
        self.accept = 0

    @classmethod
    def compile(cls, regex: str, limit: int = MAX_NFA_STATES) -> Nfa:
        """ValueError past `limit` states."""
        nfa = cls(limit)
        begin, end = nfa._state(), nfa._state()
        nfa._build(list(sre.parse(regex)), begin, end)
        nfa.accept = end
        nfa.start = nfa.closure({begin})
        return nfa

    def _state(self) -> int:
        if len(self.edges) >= self.limit:
            raise ValueError("pattern too large to track")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def _build(self, items: list[Any], begin: int, end: int) -> None:
        current = begin
        for op, arg in items:
            nxt = self._state()
            self._item(op, arg, current, nxt)
            current = nxt
        self.eps[current].append(end)

    def _item(self, op: Any, arg: Any, begin: int, end: int) -> None:
        name = str(op)
        if name == "LITERAL":
            self.edges[begin].append((arg, arg, end))
        elif name == "IN":
            for kind, value in arg:
                if str(kind) == "LITERAL":
                    self.edges[begin].append((value, value, end))
                elif str(kind) == "RANGE":
                    self.edges[begin].append((value[0], value[1], end))
                else:
                    raise ValueError(f"unsupported class member {kind}")
        elif name == "SUBPATTERN":
            self._build(list(arg[-1]), begin, end)
        elif name == "BRANCH":
            for branch in arg[1]:
                self._build(list(branch), begin, end)
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):
            low, high, sub = arg
            current = begin
            for _ in range(low):
                nxt = self._state()
                self._build(list(sub), current, nxt)
                current = nxt
            if high == sre.MAXREPEAT:
                loop = self._state()
                self.eps[current].append(loop)
                self._build(list(sub), loop, loop)
                self.eps[loop].append(end)
                return
            for _ in range(high - low):
                nxt = self._state()
                self.eps[current].append(end)
                self._build(list(sub), current, nxt)
                current = nxt
            self.eps[current].append(end)
        else:
            raise ValueError(f"unsupported pattern element {name}")

    def closure(self, states: set[int] | frozenset[int]) -> frozenset[int]:
        seen = set(states)
        todo = list(states)
        while todo:
            for nxt in self.eps[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def step(self, states: frozenset[int], char: int) -> frozenset[int]:
        targets = {target for state in states for low, high, target in self.edges[state]
                   if low <= char <= high}
        return self.closure(targets) if targets else frozenset()

    def shortest(self, states: frozenset[int]) -> bytes | None:
        """The shortest text that takes `states` to the accepting state (breadth first,
        each edge written as its lowest character)."""
        if self.accept in states:
            return b""
        came: dict[int, tuple[int, int]] = {state: (-1, 0) for state in states}
        frontier = list(states)
        while frontier:
            following = []
            for state in frontier:
                for low, _high, target in self.edges[state]:
                    for reached in self.closure({target}):
                        if reached in came:
                            continue
                        came[reached] = (state, low)
                        if reached == self.accept:
                            chars = []
                            node = reached
                            while came[node][0] != -1:
                                node, char = came[node]
                                chars.append(chr(char))
                            return "".join(reversed(chars)).encode()
                        following.append(reached)
            frontier = following
        return None
