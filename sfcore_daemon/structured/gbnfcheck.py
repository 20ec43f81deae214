"""GBNF text checked on the event loop before llama.cpp's parser sees it.

llama.cpp parses a grammar, expands its repetitions into rules and builds the stacks of
its first step inside one C call on the event loop: nothing can interrupt it. Text of a
few bytes can make that call run forever (`"a"{5,2}`: the count of optional copies
wraps around), exhaust memory (`root ::= b root "x"` with `b ::= "b"?`: a left
recursion llama.cpp does not see), or take minutes (20 rules of two alternatives each
make a million first stacks, which llama.cpp dedupes in quadratic time). So the text is
parsed here first, the way llama.cpp's parser reads it (llama-grammar.cpp), and refused
unless its structure is within these bounds:

- groups nest at most MAX_GRAMMAR_NESTING deep (llama.cpp's parser recurses per group);
- a repetition count is at most MAX_GRAMMAR_REPEAT (llama.cpp's own threshold; above it
  llama.cpp silently drops an upper bound), and its minimum is not above its maximum;
- at most MAX_GRAMMAR_RULES rules and MAX_GRAMMAR_ELEMENTS elements once repetitions are
  expanded as llama.cpp expands them (its memory, and the copy `closer.py` makes);
- from any one point, at most MAX_GRAMMAR_BRANCHES alternatives can be reached before
  the next character (nested groups and referenced rules included): the alternation
  width that sets how many stacks one step makes;
- no rule can begin with itself (left recursion, also through rules that can match
  nothing, which llama.cpp does not see: it then builds ever longer stacks).

Every refusal is a `GrammarError` naming the request field. Pure Python, no llama.cpp;
iterative, so no input can exhaust the interpreter's stack.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Final


class GrammarError(ValueError):
    """The request's schema or grammar cannot be used; the message says why (and where)."""


MAX_GRAMMAR_NESTING: Final = 64
MAX_GRAMMAR_REPEAT: Final = 2000  # llama.cpp's MAX_REPETITION_THRESHOLD
MAX_GRAMMAR_RULES: Final = 32768
MAX_GRAMMAR_ELEMENTS: Final = 1 << 20
MAX_GRAMMAR_BRANCHES: Final = 4096

# Sizes beyond this are only compared with the limits above: kept from growing into
# huge integers by stacked repetitions.
_CAP: Final = 1 << 40

_SPACE: Final = re.compile(r"(?:[ \t]|#[^\r\n]*)*")
_SPACE_NEWLINE: Final = re.compile(r"(?:[ \t\r\n]|#[^\r\n]*)*")
_NAME: Final = re.compile(r"[a-zA-Z0-9-]+")
_ESCAPE: Final = r"\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[trn\\\"\[\]-])"
_LITERAL: Final = re.compile(r'"((?:[^"\\]|' + _ESCAPE + ')*)"')
_CLASS: Final = re.compile(r"\[\^?((?:[^\]\\]|" + _ESCAPE + r")*)\]")
_ESCAPES: Final = re.compile(_ESCAPE)
_TOKEN: Final = re.compile(r"!?<(?:\[([0-9]{1,10})\]|[^\[>][^>]*|)>")
_DIGITS: Final = re.compile(r"[0-9]+")

# An element of a sequence: the rule it refers to (-1: characters or a token), its
# elements before repetition, and its repetitions in order, (min, max or None).
_Item = tuple[int, int, list[tuple[int, int | None]]]


class _Source:
    """How the messages name the text: the request's grammar, or one made from a field."""

    def __init__(self, field: str) -> None:
        self.field = field
        self.name = "the grammar" if field == "grammar" else f"the grammar made from {field}"

    def error(self, message: str) -> GrammarError:
        return GrammarError(f"{message} - at `$.{self.field}`")

    def syntax(self, reason: str, text: str, pos: int) -> GrammarError:
        snippet = text[pos:pos + 40]
        return self.error(f"{self.name} does not parse: {reason} at {snippet!r}")


def check_gbnf(text: str, field: str = "grammar", *,
               max_nesting: int = MAX_GRAMMAR_NESTING) -> None:
    """Refuse GBNF text llama.cpp's parser should not be handed: GrammarError naming
    `field` for a syntax error llama.cpp would report, or structure past the bounds."""
    key = (text, field, max_nesting)
    with _passed_lock:
        if key in _passed:
            _passed.move_to_end(key)
            return
    source = _Source(field)
    if "\x00" in text:
        raise source.error(f"{source.name.removeprefix('the ')} contains a NUL character")
    parsed = _Parser(text, source, max_nesting).parse()
    _Analysis(parsed, source).check()
    if len(text) <= _REMEMBERED_CHARS:
        with _passed_lock:
            _passed[key] = None
            if len(_passed) > _REMEMBERED:
                _passed.popitem(last=False)


# Grammars that passed, most recent last: clients send the same one again, and a check
# is not free (docs/performance/design.md, "Grammar checks").
_REMEMBERED: Final = 128
_REMEMBERED_CHARS: Final = 1 << 16
_passed: OrderedDict[tuple[str, str, int], None] = OrderedDict()
_passed_lock = threading.Lock()


class _Parsed:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}  # rule name -> id
        self.defined: set[str] = set()
        self.bodies: list[list[list[_Item]]] = []  # id -> alternatives

    def rule_id(self, name: str) -> int:
        found = self.ids.get(name)
        if found is None:
            found = self.ids[name] = self.new_rule()
        return found

    def new_rule(self) -> int:
        self.bodies.append([[]])
        return len(self.bodies) - 1


class _Parser:
    """llama.cpp's grammar syntax (llama_grammar_parser), with an explicit stack of open
    groups in place of its recursion."""

    def __init__(self, text: str, source: _Source, max_nesting: int) -> None:
        self.text = text
        self.source = source
        self.max_nesting = max_nesting
        self.parsed = _Parsed()

    def parse(self) -> _Parsed:
        text = self.text
        pos = _skip(text, 0, True)
        while pos < len(text):
            pos = self._rule(pos)
        parsed = self.parsed
        for name in parsed.ids:
            if name not in parsed.defined:
                raise self.source.error(f"{self.source.name} does not parse: Undefined rule "
                                        f"identifier {name!r}")
        return parsed

    def _fail(self, reason: str, pos: int) -> GrammarError:
        return self.source.syntax(reason, self.text, pos)

    def _rule(self, pos: int) -> int:
        text, parsed = self.text, self.parsed
        name = _NAME.match(text, pos)
        if name is None:
            raise self._fail("expecting name", pos)
        pos = _skip(text, name.end(), False)
        if not text.startswith("::=", pos):
            raise self._fail("expecting ::=", pos)
        rule = parsed.rule_id(name.group())
        parsed.defined.add(name.group())
        parsed.bodies[rule] = [[]]
        pos = self._alternates(rule, _skip(text, pos + 3, True))
        if text.startswith("\r\n", pos):
            pos += 2
        elif pos < len(text) and text[pos] in "\r\n":
            pos += 1
        elif pos < len(text):
            raise self._fail("expecting newline or end", pos)
        return _skip(text, pos, True)

    def _alternates(self, rule: int, pos: int) -> int:
        """The body of `rule` up to the end of its definition; returns the position after."""
        text, parsed = self.text, self.parsed
        open_groups = [rule]  # the rule, then each group opened inside it
        last: list[_Item | None] = [None]  # per level: the item a repetition applies to
        while True:
            nested = len(open_groups) > 1
            body = parsed.bodies[open_groups[-1]]
            char = text[pos] if pos < len(text) else ""
            item: _Item | None = None
            if char == '"':
                match = _LITERAL.match(text, pos)
                if match is None:
                    raise self._fail("bad literal (unknown escape or no closing quote)", pos)
                size = _decoded_length(match.group(1))
                item, end = ((-1, size, []) if size else None), match.end()
            elif char == "[":
                match = _CLASS.match(text, pos)
                if match is None:
                    raise self._fail("bad character class (unknown escape or no closing ])",
                                     pos)
                size = _decoded_length(match.group(1))
                item, end = ((-1, size, []) if size else None), match.end()
            elif char in ("<", "!"):
                match = _TOKEN.match(text, pos)
                if match is None or (match.group(1) and int(match.group(1)) >= 1 << 32):
                    raise self._fail("bad token", pos)
                item, end = (-1, 1, []), match.end()
            elif char == ".":
                item, end = (-1, 1, []), pos + 1
            elif char and (char.isascii() and (char.isalnum() or char == "-")):
                match = _NAME.match(text, pos)
                assert match is not None
                item, end = (parsed.rule_id(match.group()), 1, []), match.end()
            elif char == "(":
                if len(open_groups) > self.max_nesting:
                    raise self.source.error(f"{self.source.name.removeprefix('the ')} nests "
                                            f"groups deeper than {self.max_nesting}")
                open_groups.append(parsed.new_rule())
                last.append(None)
                pos = _skip(text, pos + 1, True)
                continue
            elif char in ("*", "+", "?", "{"):
                pos = self._repeat(last[-1], pos, nested)
                continue
            elif char == "|":
                body.append([])
                last[-1] = None
                pos = _skip(text, pos + 1, True)
                continue
            elif char == ")" and nested:
                group = open_groups.pop()
                last.pop()
                item, end = (group, 1, []), pos + 1
                nested = len(open_groups) > 1
                body = parsed.bodies[open_groups[-1]]
            elif nested:
                raise self._fail("expecting ')'", pos)
            else:
                return pos
            if item is not None:
                body[-1].append(item)
            last[-1] = item
            pos = _skip(text, end, nested)

    def _repeat(self, item: _Item | None, pos: int, nested: bool) -> int:
        """Apply `*`, `+`, `?` or `{m,n}` at `pos` to `item`; the position after it."""
        if item is None:
            raise self._fail("expecting preceding item to */+/?/{", pos)
        text = self.text
        char = text[pos]
        high: int | None
        if char == "{":
            low_text, end = self._int(_skip(text, pos + 1, nested))
            end = _skip(text, end, nested)
            high_text: str | None = low_text
            if text.startswith(",", end):
                end = _skip(text, end + 1, nested)
                high_text = None
                if text[end:end + 1] in tuple("0123456789"):
                    high_text, end = self._int(end)
                    end = _skip(text, end, nested)
            if not text.startswith("}", end):
                raise self._fail("expecting '}'", end)
            end += 1
            for digits in (low_text, high_text):
                if digits and (len(digits) > 9 or int(digits) > MAX_GRAMMAR_REPEAT):
                    raise self.source.error(
                        f"{self.source.name} repeats something {digits} times; at most "
                        f"{MAX_GRAMMAR_REPEAT} are supported (llama.cpp would drop a larger "
                        "bound)")
            low, high = int(low_text), (int(high_text) if high_text else None)
            if high is not None and low > high:
                raise self.source.error(f"{self.source.name} has a repetition "
                                        f"{{{low},{high}}} whose minimum is above its maximum")
        else:
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
            end = pos + 1
        item[2].append((low, high))
        return _skip(text, end, nested)

    def _int(self, pos: int) -> tuple[str, int]:
        match = _DIGITS.match(self.text, pos)
        if match is None:
            raise self._fail("expecting an int", pos)
        return match.group(), match.end()


def _skip(text: str, pos: int, newline_ok: bool) -> int:
    """Past spaces and comments (and newlines where the syntax allows them)."""
    match = (_SPACE_NEWLINE if newline_ok else _SPACE).match(text, pos)
    return match.end() if match else pos


def _decoded_length(body: str) -> int:
    """Characters in a literal's or class's text once escapes are decoded: llama.cpp
    makes one element of each."""
    return len(_ESCAPES.sub("e", body)) if "\\" in body else len(body)


class _Analysis:
    """Sizes after expansion, left recursion and the alternatives one step can reach."""

    def __init__(self, parsed: _Parsed, source: _Source) -> None:
        self.bodies = parsed.bodies
        self.names = {rule: name for name, rule in parsed.ids.items()}
        self.source = source
        self.nullable = [False] * len(self.bodies)
        self.branches = [0] * len(self.bodies)  # stacks from expanding the rule

    def check(self) -> None:
        self._sizes()
        self._find_nullable()
        self._count_branches()

    def _too_large(self, what: str, count: int, limit: int) -> GrammarError:
        shown = f"{count}" if count < _CAP else "an enormous number of"
        return self.source.error(f"{self.source.name} is too large: {shown} {what} once "
                                 f"its repetitions are expanded, more than {limit}")

    def _sizes(self) -> None:
        rules = len(self.bodies)
        elements = 0
        for body in self.bodies:
            for alternative in body:
                elements += 1  # the alternative's end
                for _, base, repeats in alternative:
                    size = base
                    for low, high in repeats:
                        # S{m,n}: m copies of S in place, and n-m rules `S' ::= S S'' |`
                        optional = 1 if high is None else high - low
                        rules += optional
                        elements = min(_CAP, elements + optional * (size + 3))
                        size = min(_CAP, low * size + (1 if optional else 0))
                    elements = min(_CAP, elements + size)
            if rules > MAX_GRAMMAR_RULES:
                raise self._too_large("rules", rules, MAX_GRAMMAR_RULES)
            if elements > MAX_GRAMMAR_ELEMENTS:
                raise self._too_large("elements", elements, MAX_GRAMMAR_ELEMENTS)

    def _item_nullable(self, item: _Item) -> bool:
        rule, _, repeats = item
        return any(low == 0 for low, _ in repeats) or (rule >= 0 and self.nullable[rule])

    def _find_nullable(self) -> None:
        """Which rules can match nothing: a worklist, linear in the grammar's size."""
        waiting: list[list[tuple[int, int]]] = [[] for _ in self.bodies]  # rule -> alts
        missing: dict[tuple[int, int], int] = {}
        ready: list[int] = []
        for rule, body in enumerate(self.bodies):
            for index, alternative in enumerate(body):
                needed = 0
                for item in alternative:
                    target, _, repeats = item
                    if any(low == 0 for low, _ in repeats):
                        continue
                    if target < 0:
                        needed = -1
                        break
                    needed += 1
                    waiting[target].append((rule, index))
                if needed == 0:
                    ready.append(rule)
                elif needed > 0:
                    missing[(rule, index)] = needed
        while ready:
            rule = ready.pop()
            if self.nullable[rule]:
                continue
            self.nullable[rule] = True
            for key in waiting[rule]:
                if key in missing:
                    missing[key] -= 1
                    if missing[key] == 0:
                        ready.append(key[0])

    def _count_branches(self) -> None:
        """The stacks expanding each rule makes (depth first along the rules each one can
        begin with; meeting a rule still open is left recursion), then the most that any
        one point of any sequence can reach."""
        done = [False] * len(self.bodies)
        for start in range(len(self.bodies)):
            if done[start]:
                continue
            open_rules = {start}
            path = [(start, iter(self._first_rules(start)))]
            while path:
                rule, following = path[-1]
                target = next(following, None)
                if target is None:
                    path.pop()
                    open_rules.discard(rule)
                    self.branches[rule] = min(_CAP, sum(
                        self._reach(alternative, 0) for alternative in self.bodies[rule]))
                    done[rule] = True
                elif target in open_rules:
                    raise self._left_recursion(target)
                elif not done[target]:
                    open_rules.add(target)
                    path.append((target, iter(self._first_rules(target))))
        widest = max(self.branches, default=0)  # the root's make the first stacks
        for body in self.bodies:
            for alternative in body:
                reach = 0  # from each point to the end of the alternative, backwards
                for item in reversed(alternative):
                    reach = self._item_branches(item) + (reach if self._item_nullable(item)
                                                         else 0)
                    widest = max(widest, min(reach, _CAP))
        if widest > MAX_GRAMMAR_BRANCHES:
            shown = f"{widest}" if widest < _CAP else "an enormous number of"
            raise self.source.error(
                f"{self.source.name} is too wide: {shown} alternatives can be reached from "
                f"one point before the next character, more than {MAX_GRAMMAR_BRANCHES}")

    def _first_rules(self, rule: int) -> list[int]:
        """The rules `rule` can begin with: each referenced rule up to and including the
        first item that cannot match nothing, in every alternative. A repetition without
        an upper bound of something that can match nothing begins with itself."""
        first = []
        for alternative in self.bodies[rule]:
            for item in alternative:
                target = item[0]
                if target >= 0:
                    first.append(target)
                if not self._item_nullable(item):
                    break
        return first

    def _item_branches(self, item: _Item) -> int:
        target, _, repeats = item
        count = 1 if target < 0 else self.branches[target]
        nullable = target >= 0 and self.nullable[target]
        for low, high in repeats:
            if nullable:  # every copy can be skipped: each one's stacks are reachable
                count *= max(1, low + 1 if high is None else high)
            nullable = nullable or low == 0
            count = min(count, _CAP)
        return count

    def _reach(self, alternative: list[_Item], start: int) -> int:
        reach = 0
        for item in alternative[start:]:
            reach = min(_CAP, reach + self._item_branches(item))
            if not self._item_nullable(item):
                break
        return reach

    def _left_recursion(self, rule: int) -> GrammarError:
        name = self.names.get(rule)
        where = f"rule {name!r}" if name is not None else "a group"
        return self.source.error(f"{self.source.name} does not parse: left recursion: "
                                 f"{where} can begin with itself")
