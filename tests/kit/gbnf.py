"""Whether a GBNF grammar accepts a text: a small recogniser for the tests.

It reads the subset of GBNF the schema compiler writes (literals, character classes,
rule references, groups, `|`, and the quantifiers * + ? {m} {m,} {m,n}) and matches a
whole text against the root rule, keeping the set of positions every element can end
at. Grammars without left recursion only (a schema's grammar always reads a "{" or a
"[" before it recurses).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

Matcher = Callable[[str, int], frozenset[int]]

_NAME = re.compile(r"[a-zA-Z0-9-]+")
_COUNT = re.compile(r"\{([0-9]+)(,([0-9]*))?\}")
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]",
            "-": "-", "/": "/"}


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a whole document of `grammar` (its rule `root`)."""
    return len(text) in _Grammar(grammar).rules["root"](text, 0)


class _Grammar:
    def __init__(self, text: str) -> None:
        self.rules: dict[str, Matcher] = {}
        for line in text.split("\n"):  # llama.cpp ends a line at \n only, not at NEL or U+2028
            if line.strip() and not line.lstrip().startswith("#"):
                name, body = line.split(" ::= ", 1)
                self.rules[name.strip()] = self._rule(name.strip(), body)

    def _rule(self, name: str, body: str) -> Matcher:
        self._text, self._pos = body, 0
        inner = self._alternatives()
        assert self._pos == len(self._text.rstrip()), (name, body[self._pos:])
        return functools.lru_cache(maxsize=None)(inner)

    # --- parsing --------------------------------------------------------------------

    def _skip(self) -> None:
        while self._pos < len(self._text) and self._text[self._pos] == " ":
            self._pos += 1

    def _peek(self) -> str:
        self._skip()
        return self._text[self._pos:self._pos + 1]

    def _alternatives(self) -> Matcher:
        options = [self._sequence()]
        while self._peek() == "|":
            self._pos += 1
            options.append(self._sequence())
        if len(options) == 1:
            return options[0]
        return lambda text, pos: frozenset().union(*(option(text, pos) for option in options))

    def _sequence(self) -> Matcher:
        items: list[Matcher] = []
        while self._peek() not in ("", "|", ")"):
            items.append(self._quantified(self._atom()))

        def match(text: str, pos: int) -> frozenset[int]:
            ends = frozenset({pos})
            for item in items:
                ends = frozenset().union(*(item(text, end) for end in ends))
                if not ends:
                    break
            return ends
        return match

    def _atom(self) -> Matcher:
        char = self._peek()
        if char == '"':
            literal = self._literal()
            return lambda text, pos: (frozenset({pos + len(literal)})
                                      if text.startswith(literal, pos) else frozenset())
        if char == "[":
            return self._class()
        if char == "(":
            self._pos += 1
            inner = self._alternatives()
            assert self._peek() == ")", self._text[self._pos:]
            self._pos += 1
            return inner
        found = _NAME.match(self._text, self._pos)
        assert found, self._text[self._pos:]
        self._pos = found.end()
        name = found.group()

        def reference(text: str, pos: int) -> frozenset[int]:
            return self.rules[name](text, pos)  # looked up late: rules refer ahead
        return reference

    def _char(self) -> str:
        char = self._text[self._pos]
        self._pos += 1
        if char != "\\":
            return char
        code = self._text[self._pos]
        self._pos += 1
        if code in "xuU":
            size = {"x": 2, "u": 4, "U": 8}[code]
            value = chr(int(self._text[self._pos:self._pos + size], 16))
            self._pos += size
            return value
        return _ESCAPES[code]

    def _literal(self) -> str:
        self._pos += 1
        chars = []
        while self._text[self._pos] != '"':
            chars.append(self._char())
        self._pos += 1
        return "".join(chars)

    def _class(self) -> Matcher:
        self._pos += 1
        negated = self._text[self._pos] == "^"
        if negated:
            self._pos += 1
        ranges = []
        while self._text[self._pos] != "]":
            low = self._char()
            high = low
            if self._text[self._pos] == "-" and self._text[self._pos + 1] != "]":
                self._pos += 1
                high = self._char()
            ranges.append((low, high))
        self._pos += 1

        def match(text: str, pos: int) -> frozenset[int]:
            if pos < len(text) and any(low <= text[pos] <= high
                                       for low, high in ranges) != negated:
                return frozenset({pos + 1})
            return frozenset()
        return match

    def _quantified(self, atom: Matcher) -> Matcher:
        char = self._text[self._pos:self._pos + 1]
        low: int = 1
        high: int | None = 1
        if char in ("*", "+", "?"):
            self._pos += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{":
            count = _COUNT.match(self._text, self._pos)
            assert count, self._text[self._pos:]
            self._pos = count.end()
            low = int(count.group(1))
            high = low if count.group(2) is None else (
                int(count.group(3)) if count.group(3) else None)
        else:
            return atom
        return _repeat(atom, low, high)


def _repeat(atom: Matcher, low: int, high: int | None) -> Matcher:
    def match(text: str, pos: int) -> frozenset[int]:
        ends = frozenset({pos})
        found = set(ends) if low == 0 else set()
        seen: set[int] = set(ends)
        count = 0
        while ends and (high is None or count < high):
            ends = frozenset().union(*(atom(text, end) for end in ends))
            count += 1
            if count >= low:
                found |= ends
            if high is None:  # past the minimum only new positions can add anything
                if count >= low:
                    ends = frozenset(ends - seen)
                seen |= ends
        return frozenset(found)
    return match
