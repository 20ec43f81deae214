"""The regular expressions a JSON Schema `pattern` may use, and the GBNF they become.

A pattern is checked by parsing it into a small tree, and the grammar is written from
that tree (`pattern_gbnf`), so what was checked is exactly what is converted.
llama-cpp-python's own pattern converter is not used: a stray `]` or `}` sends it into an
endless loop, `^a|b$` comes out as a grammar whose strings need not close, and it
writes every counted repetition out in full.

Supported, between the outer ^ and $: literal characters; the escapes \\( \\) \\[ \\] \\{ \\}
\\| \\* \\+ \\?; positive classes such as [abc] and [a-z] (no escapes inside, no
negation); groups ( ); alternatives |; and one quantifier (* + ? {m} {m,} {m,n}, counts
up to MAX_REPEAT) after a character, class or group. Not supported: `.`, other
anchors, (? groups, and characters a JSON string must escape (the grammar writes the
string's characters raw). Every refusal is a GrammarError naming the place.
"""

from __future__ import annotations

import re
from typing import Final

from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_REPEAT, GrammarError

MAX_PATTERN_NESTING: Final = 32

# Regex escapes that stand for the plain character.
_ESCAPES: Final = frozenset("()[]{}|*+?")
# Characters a JSON string may not hold raw: a pattern that can produce one would make
# the grammar write invalid JSON.
_JSON_UNSAFE: Final = frozenset('"\\\x7f') | frozenset(map(chr, range(0x20)))
_COUNT: Final = re.compile(r"\{([0-9]{1,9})(?:(,)([0-9]{1,9})?)?\}")

# The tree: an alternation is a list of sequences; a sequence a list of items, each an
# atom and its quantifier ("" or the GBNF quantifier text, with its minimum and maximum).
_Atom = tuple[str, "str | list[list[_Item]]"]  # ("char" | "class", text) or ("group", alts)
_Item = tuple[_Atom, str, bool]  # (atom, quantifier, whether the item can match nothing)


def check_pattern(body: str, path: str) -> None:
    """GrammarError naming `path` unless `body` (a pattern without its ^ and $) is in the
    supported subset."""
    _Parser(body, path).parse()


def pattern_gbnf(body: str) -> str:
    """GBNF for the characters of strings matching a checked pattern body."""
    alternatives = _Parser(body, "$").parse()
    text = _alternatives(alternatives)
    return f"({text})" if len(alternatives) > 1 else text


class _Parser:
    def __init__(self, body: str, path: str) -> None:
        self.body = body
        self.path = path
        self.pos = 0

    def fail(self, message: str) -> GrammarError:
        return GrammarError(f"{message} - at `{self.path}`")

    def parse(self) -> list[list[_Item]]:
        alternatives = self._alternatives(0)
        if self.pos < len(self.body):  # only a `)` stops the top level early
            raise self.fail("unbalanced ) in pattern")
        return alternatives

    def _alternatives(self, depth: int) -> list[list[_Item]]:
        alternatives = [self._sequence(depth)]
        while self.body[self.pos:self.pos + 1] == "|":
            self.pos += 1
            alternatives.append(self._sequence(depth))
        return alternatives

    def _sequence(self, depth: int) -> list[_Item]:
        body = self.body
        items: list[_Item] = []
        while self.pos < len(body):
            char = body[self.pos]
            if char in "|)":
                break
            if char in "*+?{":
                if not items or items[-1][1]:
                    raise self.fail(f"pattern quantifier {char!r} must follow a character, "
                                    "class or group (and only one may)")
                items[-1] = self._quantified(items[-1])
                continue
            items.append(self._atom(char, depth))
        return items

    def _atom(self, char: str, depth: int) -> _Item:
        body = self.body
        if char == "\\":
            escaped = body[self.pos + 1:self.pos + 2]
            if escaped not in _ESCAPES or not escaped:
                raise self.fail(f"pattern escape {body[self.pos:self.pos + 2]!r} is not "
                                "supported (write a class such as [0-9] or [.])")
            self.pos += 2
            return ("char", escaped), "", False
        if char == "[":
            return ("class", self._class()), "", False
        if char == "(":
            if body[self.pos + 1:self.pos + 2] == "?":
                raise self.fail("pattern groups with (? are not supported")
            if depth >= MAX_PATTERN_NESTING:
                raise self.fail(f"pattern groups nest deeper than {MAX_PATTERN_NESTING}")
            self.pos += 1
            alternatives = self._alternatives(depth + 1)
            if body[self.pos:self.pos + 1] != ")":
                raise self.fail("unbalanced ( in pattern")
            self.pos += 1
            empty = any(all(nullable for _, _, nullable in sequence)
                        for sequence in alternatives)
            return ("group", alternatives), "", empty
        if char == ".":
            raise self.fail("pattern '.' is not supported (write a class such as "
                            "[a-zA-Z0-9 ])")
        if char in "^$":
            raise self.fail(f"pattern anchor {char!r} is supported only at the start and "
                            "the end")
        if char in "]}":
            raise self.fail(f"pattern character {char!r} must be escaped (\\{char})")
        if char in _JSON_UNSAFE:
            raise self.fail(f"pattern character {char!r} must be escaped in JSON and is not "
                            "supported")
        self.pos += 1
        return ("char", char), "", False

    def _class(self) -> str:
        body = self.body
        end = body.find("]", self.pos + 1)
        if end < 0:
            raise self.fail("unbalanced [ in pattern")
        members = body[self.pos + 1:end]
        if members.startswith("^") or "\\" in members or not members:
            raise self.fail(f"pattern class [{members}] is not supported (no negated "
                            "classes, no escapes inside brackets)")
        if "[" in members or any(twice in members for twice in ("--", "&&", "~~", "||")):
            raise self.fail(f"pattern class [{members}] is not supported (no [ and no "
                            "doubled - & ~ | inside brackets)")
        low = 0
        while low < len(members):
            if low + 2 < len(members) and members[low + 1] == "-":
                first, last = ord(members[low]), ord(members[low + 2])
                low += 3
            else:
                first = last = ord(members[low])
                low += 1
            if first > last:
                raise self.fail(f"pattern class [{members}] has a range that runs backwards")
            if any(first <= ord(unsafe) <= last for unsafe in _JSON_UNSAFE):
                raise self.fail(f"pattern class [{members}] includes characters a JSON "
                                "string must escape")
        self.pos = end + 1
        return members

    def _quantified(self, item: _Item) -> _Item:
        atom, _, nullable = item
        body = self.body
        char = body[self.pos]
        if char == "{":
            match = _COUNT.match(body, self.pos)
            if match is None:
                raise self.fail("pattern quantifier must be {m}, {m,} or {m,n} (write \\{ "
                                "for the character)")
            low = int(match.group(1))
            high = None if match.group(2) and match.group(3) is None else int(
                match.group(3) or match.group(1))
            if max(low, high or 0) > MAX_GRAMMAR_REPEAT:
                raise self.fail(f"pattern quantifier counts may be at most "
                                f"{MAX_GRAMMAR_REPEAT}")
            if high is not None and low > high:
                raise self.fail(f"pattern quantifier {match.group()} has its minimum above "
                                "its maximum")
            text = match.group()
            self.pos = match.end()
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            text = char
            self.pos += 1
        if nullable and high is None:  # llama.cpp refuses it as a left recursion
            raise self.fail("pattern repeats something that can be empty without an upper "
                            "bound")
        return atom, text, nullable or low == 0


def _alternatives(alternatives: list[list[_Item]]) -> str:
    return " | ".join(_sequence(sequence) for sequence in alternatives)


def _sequence(sequence: list[_Item]) -> str:
    parts: list[str] = []
    literal = ""  # unquantified characters, written as one literal
    for (kind, value), quantifier, _ in sequence:
        if kind == "char" and not quantifier:
            literal += str(value)
            continue
        if literal:
            parts.append(f'"{literal}"')
            literal = ""
        if kind == "char":
            parts.append(f'"{value}"{quantifier}')
        elif kind == "class":
            parts.append(f"[{value}]{quantifier}")
        else:
            assert isinstance(value, list)
            parts.append(f"({_alternatives(value)}){quantifier}")
    if literal:
        parts.append(f'"{literal}"')
    return " ".join(parts)
