"""GBNF text written from a schema's shapes (shape.py), the one form a schema is walked into.

`shape_gbnf(shape)` reads nothing but the shape tree: the grammar and the closing shape
cannot disagree about a document, since the grammar is derived from the shape. The text
is the one llama.cpp's json-schema-to-grammar converter (llama-cpp-python's
`SchemaConverter`) wrote for the same schema, rule names included, with these fixes:

- literals escape backslashes (enum values such as "a\\\\b" broke the grammar), and
  string characters follow JSON (no raw control characters, no lone surrogate escapes);
- integer bounds, and repetitions past CONVERTER_REPEAT as counted GBNF;
- patterns are written by pattern.py, and so are the string formats (from the regular
  expression shape.py also builds their NFA from);
- a $ref has a rule of its own, named after its last segment but never taking a rule of
  that name ("string", say);
- rule names are cut short and collisions numbered in constant time, and an object's
  optional properties are chained without recursion.

`json_gbnf()` is llama.cpp's json.gbnf (any JSON object, `format: "json"`), with the
same string escapes.
"""

from __future__ import annotations

import json
import re
from typing import Final

from sfcore_daemon.structured.checker import MAX_INTEGER_BOUND
from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_NESTING
from sfcore_daemon.structured.pattern import pattern_gbnf
from sfcore_daemon.structured.shape import Shape

# Up to this count a bounded repetition is nested groups, one per count (llama.cpp's parser
# recurses into each); past it `{m,n}`, which llama.cpp expands into small rules.
CONVERTER_REPEAT: Final = 256
# The nesting a schema's grammar may reach: the repetitions' groups, and a pattern's.
SCHEMA_GRAMMAR_NESTING: Final = CONVERTER_REPEAT + MAX_GRAMMAR_NESTING
# Rule names from property and definition names are cut to this length (collisions get
# a suffix), so long names nested deep do not multiply into a huge grammar.
_RULE_NAME_CHARS: Final = 64

# JSON string characters: control characters must be escaped, and a \u escape may not
# name half of a surrogate pair (llama-cpp-python's rule allowed both).
_NO_SURROGATE_ESCAPE: Final = r'"u" ([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})'
_CHAR_RULE: Final = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | ' + _NO_SURROGATE_ESCAPE + ")"

# llama.cpp's built-in rules (json-schema-to-grammar), each with the rules it uses.
_SPACE_RULE: Final = '" "?'
_UP_TO_15_DIGITS: Final = ("([0-9] " * 15).rstrip() + ")?" * 15
_PRIMITIVES: Final[dict[str, tuple[str, tuple[str, ...]]]] = {
    "boolean": ('("true" | "false") space', ()),
    "decimal-part": ("[0-9] " + _UP_TO_15_DIGITS, ()),
    "integral-part": ("[0-9] | [1-9] " + _UP_TO_15_DIGITS, ()),
    # An exponent of at most two digits: every number the grammar admits is a finite
    # double, so a reader (msgspec, JavaScript) never meets one out of range.
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9] [0-9]?)? space',
               ("integral-part", "decimal-part")),
    "integer": ('("-"? integral-part) space', ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": ('"{" space ( string ":" space value ("," space string ":" space value)* )? '
               '"}" space', ("string", "value")),
    "array": ('"[" space ( value ("," space value)* )? "]" space', ("value",)),
    "char": (_CHAR_RULE, ()),
    "string": (r'"\"" char* "\"" space', ("char",)),
    "null": ('"null" space', ()),
}
# Names a rule made from a schema never takes (the converter's built-in and format rules).
_RESERVED: Final = frozenset({"root", "dot", "uuid", "date", "time", "date-time",
                              "date-string", "time-string", "date-time-string",
                              *_PRIMITIVES})
_INVALID_RULE_CHARS: Final = re.compile(r"[^a-zA-Z0-9-]+")


def shape_gbnf(shape: Shape) -> str:
    """The GBNF of the documents of `shape` (a schema's root), rules sorted by name."""
    emitter = _Emitter()
    emitter.visit(shape, "")
    return "\n".join(f"{name} ::= {rule}" for name, rule in sorted(emitter.rules.items()))


class _Emitter:
    """One pass over the shapes, in the converter's order: rule names (and the numbers
    that tell colliding ones apart) come out as the converter's did."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {"space": _SPACE_RULE}
        self._ref_rules: dict[str, str] = {}
        self._numbered: dict[tuple[str, str], str] = {}
        self._next_number: dict[str, int] = {}

    def visit(self, shape: Shape, name: str) -> str:
        """The rule (its name) for values of `shape` at the place `name` says."""
        name = name[:_RULE_NAME_CHARS]
        rule_name = name + "-" if name in _RESERVED else name or "root"
        kind = shape.kind
        if shape.ref is not None:
            return self._add_rule(rule_name, self._ref_rule(shape))
        if kind == "alt":
            label = f"{name}-" if name else "alternative-"
            return self._add_rule(rule_name, " | ".join(
                self.visit(alt, f"{label}{i}") for i, alt in enumerate(shape.alts)))
        if kind == "literal":
            if shape.typed:
                primitive = "null" if shape.literals == [b"null"] else "boolean"
                return self._primitive("root" if rule_name == "root" else primitive, primitive)
            return self._add_rule(rule_name, " | ".join(
                _literal(literal.decode()) for literal in shape.literals))
        if kind == "object":
            if shape.extra is not None and shape.extra.kind == "any":
                return self._add_rule(rule_name, self._primitive("object"))
            return self._add_rule(rule_name, self._object(shape, name))
        if kind == "array":
            return self._array(shape, name, rule_name)
        if kind in ("pattern", "untracked"):
            body = pattern_gbnf(shape.regex)
            return self._add_rule(rule_name, f'"\\"" {body} "\\"" space')
        if kind == "string":
            return self._string(shape, rule_name)
        if kind == "integer" and (shape.low is not None or shape.high is not None):
            return self._add_rule(rule_name,
                                  integer_range_gbnf(shape.low, shape.high) + " space")
        primitive = {"any": "value", "integer": "integer", "number": "number"}[kind]
        return self._primitive("root" if rule_name == "root" else primitive, primitive)

    def _add_rule(self, name: str, rule: str) -> str:
        key = _INVALID_RULE_CHARS.sub("-", name[:_RULE_NAME_CHARS]) or "rule"
        if key not in self.rules or self.rules[key] == rule:
            self.rules[key] = rule
            return key
        numbered = self._numbered.get((key, rule))
        if numbered is None:
            number = self._next_number.get(key, 0)
            while f"{key}{number}" in self.rules:
                number += 1
            self._next_number[key] = number + 1
            numbered = self._numbered[(key, rule)] = f"{key}{number}"
            self.rules[numbered] = rule
        return numbered

    def _primitive(self, name: str, which: str | None = None) -> str:
        """A built-in rule, under `name` (root, or its own), and the rules it uses."""
        text, uses = _PRIMITIVES[which or name]
        key = self._add_rule(name, text)
        for used in uses:
            if used not in self.rules:
                self._primitive(used)
        return key

    def _ref_rule(self, shape: Shape) -> str:
        """The rule of a $ref's target: one per target, named after the reference's last
        segment (numbered past the names taken), written on first use."""
        assert shape.ref is not None
        key = self._ref_rules.get(shape.ref)
        if key is None:
            base = _INVALID_RULE_CHARS.sub(
                "-", shape.ref.rsplit("/", 1)[-1][:_RULE_NAME_CHARS]) or "ref"
            key, number = base, 0
            while key in self.rules or key in _RESERVED:
                key, number = f"{base}-{number}", number + 1
            # Held while the target is written: a reference inside it (recursion) names
            # this rule, and no other rule can take the name.
            self.rules[key] = "\x00"
            self._ref_rules[shape.ref] = key
            self.rules[key] = self.visit(shape.alts[0], key)
        return key

    def _object(self, shape: Shape, name: str) -> str:
        prefix = f"{name}-" if name else ""
        kv_rules: dict[bytes | None, str] = {}  # None: the additional properties
        names: dict[bytes | None, str] = {None: "*"}
        for key, value in shape.props.items():
            prop_name = names[key] = _key_name(key)
            value_rule = self.visit(value, f"{prefix}{prop_name}")
            kv_rules[key] = self._add_rule(f"{prefix}{prop_name}-kv",
                                           f'{_literal(key.decode())} space ":" space '
                                           f"{value_rule}")
        optional: list[bytes | None] = list(shape.optional)
        if shape.extra is not None:
            value_rule = self.visit(shape.extra, f"{prefix}additional-value")
            string = self._primitive("string")
            kv_rules[None] = self._add_rule(f"{prefix}additional-kv",
                                            f'{string} ":" space {value_rule}')
            optional.append(None)
        rule = '"{" space ' + ' "," space '.join(kv_rules[key] for key in shape.required)
        if optional:
            rule += " ("
            if shape.required:
                rule += ' "," space ( '
            rule += " | ".join(self._optional_chains(optional, kv_rules, names, prefix))
            if shape.required:
                rule += " )"
            rule += " )?"
        return rule + ' "}" space'

    def _optional_chains(self, optional: list[bytes | None], kv_rules: dict[bytes | None, str],
                         names: dict[bytes | None, str], prefix: str) -> list[str]:
        """For each optional property, the properties it may be followed by, in order,
        each optional: a rule per tail, written from the last property backwards."""
        def head(key: bytes | None, first: bool) -> str:
            if key is None:
                kv = kv_rules[key]
                return self._add_rule(f"{prefix}additional-kvs", f'{kv} ( "," space {kv} )*')
            return kv_rules[key] if first else f'( "," space {kv_rules[key]} )?'

        rest = [""] * len(optional)  # rest[i]: the rule for what may follow i
        for i in range(len(optional) - 1, 0, -1):
            text = head(optional[i], first=False)
            if i + 1 < len(optional):
                text += " " + rest[i]
            rest[i - 1] = self._add_rule(f"{prefix}{names[optional[i - 1]]}-rest", text)
        return [head(key, first=True) + (" " + rest[i] if i + 1 < len(optional) else "")
                for i, key in enumerate(optional)]

    def _array(self, shape: Shape, name: str, rule_name: str) -> str:
        label = f"{name}-" if name else ""
        if shape.prefix is not None:
            return self._add_rule(rule_name, '"[" space ' + ' "," space '.join(
                self.visit(item, f"{label}tuple-{i}") for i, item in enumerate(shape.prefix))
                + ' "]" space')
        assert shape.items is not None
        if shape.items.kind == "any":
            return self._primitive("root" if rule_name == "root" else "array", "array")
        item = self.visit(shape.items, f"{label}item")
        low, high = shape.min, shape.max
        if low > CONVERTER_REPEAT or (high is not None and high > CONVERTER_REPEAT):
            body = item
            if high is None or high > 1:
                more = _counted(max(low - 1, 0), None if high is None else high - 1)
                body += f' ("," space {item}){more}'
            if low == 0:
                body = f"({body})?"
            if high == 0:
                body = ""
        else:
            body = _repetition(item, low, high, separator='"," space')
        return self._add_rule(rule_name, f'"[" space {body} "]" space')

    def _string(self, shape: Shape, rule_name: str) -> str:
        low, high = shape.min, shape.max
        if low == 0 and high is None:
            return self._primitive("root" if rule_name == "root" else "string", "string")
        char = self._primitive("char")
        if low > CONVERTER_REPEAT or (high is not None and high > CONVERTER_REPEAT):
            return self._add_rule(rule_name, f'"\\"" ({char}){_counted(low, high)} "\\"" space')
        return self._add_rule(rule_name, f'"\\"" {_repetition(char, low, high)} "\\"" space')


def _key_name(key: bytes) -> str:
    """A property's name from its key literal (JSON, ASCII)."""
    if b"\\" in key:
        name: str = json.loads(key.decode("ascii"))
        return name
    return key[1:-1].decode("ascii")


# Control characters and Unicode line breaks are escaped so that a grammar stays one rule a
# line for any reader that splits lines the way Python's str.splitlines does.
_LITERAL_ESCAPES = {ord("\\"): "\\\\", ord('"'): '\\"', ord("\r"): "\\r", ord("\n"): "\\n",
                    ord("\t"): "\\t", 0x2028: "\\u2028", 0x2029: "\\u2029"}
_LITERAL_ESCAPES.update({code: f"\\x{code:02x}" for code in [*range(0x20), *range(0x7F, 0xA0)]
                         if code not in _LITERAL_ESCAPES})


def _literal(text: str) -> str:
    """A GBNF literal for `text`."""
    return f'"{text.translate(_LITERAL_ESCAPES)}"'


def _repetition(item: str, low: int, high: int | None, separator: str = "") -> str:
    """`item` low to high times (high None: no bound), `separator` between, as nested
    optional groups (llama.cpp's _build_repetition)."""
    if not separator:
        if low == 0 and high == 1:
            return f"{item}?"
        if low == 1 and high is None:
            return f"{item}+"
    result = (f" {separator} " if separator else " ").join([item] * low) if low else ""

    def optional_repetitions(up_to: int, prefix_with_separator: bool) -> str:
        content = f"{separator} {item}" if prefix_with_separator and separator else item
        if up_to == 0:
            return ""
        if up_to == 1:
            return f"({content})?"
        if separator and not prefix_with_separator:
            return f"({content} {optional_repetitions(up_to - 1, True)})?"
        return (f"({content} " * up_to).rstrip() + ")?" * up_to

    if low > 0 and high != low:
        result += " "
    if high is not None:
        return result + optional_repetitions(high - low, prefix_with_separator=low > 0)
    repeated = f"({separator + ' ' if separator else ''}{item})"
    if low == 0 and separator:
        return f"({item} {repeated}*)?"
    return result + f"{repeated}*"


def _counted(low: int, high: int | None) -> str:
    """GBNF's repetition count: {m,} {m} {m,n}."""
    if high is None:
        return f"{{{low},}}"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


# --- integer bounds ---------------------------------------------------------------------


def integer_range_gbnf(low: int | None, high: int | None) -> str:
    """GBNF for the integers from `low` to `high` as JSON writes them (no leading
    zeros, no "-0"); an absent bound stops at the grammar's 16 digits."""
    lo = -MAX_INTEGER_BOUND if low is None else low
    hi = MAX_INTEGER_BOUND if high is None else high
    alternatives = []
    if lo < 0:
        alternatives.append(f'"-" ({_digits_range(max(1, -hi), -lo)})')
    if hi >= 0:
        alternatives.append(_digits_range(max(lo, 0), hi))
    return "(" + " | ".join(alternatives) + ")"


def _digits_range(low: int, high: int) -> str:
    """low..high (0 <= low <= high), one alternative per count of digits."""
    parts = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        first = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        last = min(high, 10**digits - 1)
        if first <= last:
            parts.append(_same_length(str(first), str(last)))
    return " | ".join(parts)


def _same_length(low: str, high: str) -> str:
    """The numerals from `low` to `high`, both with the same number of digits."""
    if low == high:
        return f'"{low}"'
    if low[0] == high[0]:
        return f'"{low[0]}" {_same_length(low[1:], high[1:])}'
    rest = len(low) - 1
    zeros, nines = "0" * rest, "9" * rest
    whole_from = low[0] if low[1:] == zeros else chr(ord(low[0]) + 1)
    whole_to = high[0] if high[1:] == nines else chr(ord(high[0]) - 1)
    alternatives = []
    if low[1:] != zeros:
        alternatives.append(f'"{low[0]}" {_same_length(low[1:], nines)}')
    if whole_from <= whole_to:
        alternatives.append(f"[{whole_from}-{whole_to}]" + (f" [0-9]{{{rest}}}" if rest else ""))
    if high[1:] != nines:
        alternatives.append(f'"{high[0]}" {_same_length(zeros, high[1:])}')
    return "(" + " | ".join(alternatives) + ")"


# --- any JSON object --------------------------------------------------------------------

# llama.cpp's grammars/json.gbnf as llama-cpp-python ships it (JSON_GBNF), with the
# string escapes of _CHAR_RULE. Its whitespace rule `ws` is not the schemas' `space`.
_JSON_GBNF: Final = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | NO_SURROGATE_ESCAPE) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]?)? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
""".replace("NO_SURROGATE_ESCAPE", _NO_SURROGATE_ESCAPE)


def json_gbnf() -> str:
    """The grammar of any JSON object (llama.cpp's json.gbnf)."""
    return _JSON_GBNF
