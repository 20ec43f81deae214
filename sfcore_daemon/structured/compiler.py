"""JSON Schema to GBNF, on the event loop before a request is queued.

`compile_schema` turns a client's JSON Schema into GBNF text and the shape of the
documents it describes (the closing shape). A JSON Schema is
checked and rewritten by `schemacheck.check_schema`, converted by llama-cpp-python's
converter with the fixes below, and the GBNF it comes to is held to the same structural
bounds as a client's grammar (gbnfcheck.py). Every mistake is a `GrammarError` naming
the field, answered as `invalid_request`.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Final, NamedTuple

from sfcore_daemon.structured.checker import (
    INTEGER_KEYWORDS,
    MAX_INTEGER_BOUND,
    CheckedSchema,
    check_schema,
)
from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_NESTING, check_gbnf
from sfcore_daemon.structured.pattern import pattern_gbnf
from sfcore_daemon.structured.shape import Shape, free_object, integer_bounds, shape_of

__all__ = ["CompiledSchema", "check_schema", "compile_json_object", "compile_schema",
           "integer_range_gbnf", "json_gbnf", "schema_to_gbnf"]

# Up to this count the converter writes a bounded repetition (minItems/maxItems,
# minLength/maxLength) as nested groups, one per allowed count (llama.cpp's parser
# recurses into each); past it the grammar says `{m,n}`, which llama.cpp expands into
# a chain of small rules.
CONVERTER_REPEAT: Final = 256
# The nesting a schema's grammar may reach: the converter's groups, and a pattern's.
SCHEMA_GRAMMAR_NESTING: Final = CONVERTER_REPEAT + MAX_GRAMMAR_NESTING
# Rule names the converter derives from property and definition names are cut to this
# many characters (a collision gets a numeric suffix), so that long names nested deep
# do not multiply into a huge grammar.
_RULE_NAME_CHARS: Final = 64

# JSON string characters: control characters must be escaped, and a \u escape may not
# name half of a surrogate pair (llama-cpp-python's rule allowed both).
_NO_SURROGATE_ESCAPE: Final = r'"u" ([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})'
_CHAR_RULE: Final = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | ' + _NO_SURROGATE_ESCAPE + ")"


class CompiledSchema(NamedTuple):
    """A schema compiled: the GBNF text llama.cpp's grammar sampler runs, and the shape
    of the documents it allows, which budget-aware closing (closer.py) completes."""

    gbnf: str
    shape: Shape


def compile_schema(schema: Any) -> CompiledSchema:
    """A client's JSON Schema compiled; GrammarError naming the place of the first thing
    the conversion cannot honour, or if its grammar is past the bounds of gbnfcheck.py."""
    checked = check_schema(schema)
    return CompiledSchema(checked_to_gbnf(checked), shape_of(checked.root, checked.refs))


def compile_json_object() -> CompiledSchema:
    """Any JSON object (`format: "json"`)."""
    return CompiledSchema(json_gbnf(), free_object())


def json_gbnf() -> str:
    """llama.cpp's json.gbnf (any JSON object), with string escapes as in _CHAR_RULE."""
    text: str = _converter_module().JSON_GBNF
    any_hex = '"u" [0-9a-fA-F]{4}'
    if any_hex in text:
        text = text.replace(any_hex, _NO_SURROGATE_ESCAPE)
    return text


def schema_to_gbnf(schema: Any) -> str:
    """GBNF for documents valid against `schema`; GrammarError if it uses a keyword the
    conversion cannot honour, or its grammar is past the bounds of gbnfcheck.py."""
    return checked_to_gbnf(check_schema(schema))


def checked_to_gbnf(checked: CheckedSchema) -> str:
    """The GBNF of a checked schema. The converter only ever sees a checked schema,
    which holds nothing it could trip on: an exception here is a bug of the daemon."""
    converter = _converter_class()(checked.refs)
    converter.visit(checked.root, "")
    text: str = converter.format_grammar()
    check_gbnf(text, "json_schema", max_nesting=SCHEMA_GRAMMAR_NESTING)
    return text


_module_cache: list[Any] = []


def _converter_module() -> Any:
    """llama-cpp-python's `llama_grammar` module, imported on first use.

    It needs only the standard library; `llama_c` has registered the package without
    running its `__init__` (numpy, the high-level Llama), and importing the submodule by
    its full name keeps it that way.
    """
    if not _module_cache:
        _module_cache.append(importlib.import_module("llama_cpp.llama_grammar"))
    return _module_cache[0]


_class_cache: list[Any] = []
# The key of an object's additionalProperties among its properties (the stock converter
# used "*", which a property of that name would take).
_ANY_KEY: Final = object()


def _converter_class() -> Any:
    if _class_cache:
        return _class_cache[0]
    module = _converter_module()

    class Converter(module.SchemaConverter):  # type: ignore[misc,name-defined]
        """The stock converter, fed only checked schemas (schemacheck.py), with fixes:

        - literals escape backslashes (enum values such as "a\\\\b" broke the grammar),
          and string characters follow JSON (no raw control characters, no lone
          surrogate escapes);
        - integer bounds, and repetitions past CONVERTER_REPEAT as counted GBNF;
        - patterns are written by pattern.py;
        - a $ref is resolved by its whole path to a rule of its own (the stock code
          named it by its last segment, and a rule of that name, "string" say, was
          taken for it);
        - rule names are cut short and collisions numbered in constant time, and an
          object's optional properties are chained without recursion (the stock code
          recursed once per property, and repeated the chain for each one).
        """

        def __init__(self, refs: dict[str, dict[str, Any]]) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False,
                             raw_pattern=False)
            self._refs = refs
            self._ref_rules: dict[str, str] = {}
            self._numbered: dict[tuple[str, str], str] = {}
            self._next_number: dict[str, int] = {}

        def _format_literal(self, literal: str) -> str:
            escaped = (literal.replace("\\", "\\\\").replace('"', '\\"')
                       .replace("\r", "\\r").replace("\n", "\\n"))
            return f'"{escaped}"'

        def _generate_constant_rule(self, value: Any) -> str:
            # Non-ASCII text as itself rather than as \\u escapes: the form a model writes.
            return self._format_literal(json.dumps(value, ensure_ascii=False))

        def _add_rule(self, name: str, rule: str) -> str:
            key: str = module.INVALID_RULE_CHARS_RE.sub("-", name[:_RULE_NAME_CHARS]) or "rule"
            if key not in self._rules or self._rules[key] == rule:
                self._rules[key] = rule
                return key
            numbered = self._numbered.get((key, rule))
            if numbered is None:
                number = self._next_number.get(key, 0)
                while f"{key}{number}" in self._rules:
                    number += 1
                self._next_number[key] = number + 1
                numbered = self._numbered[(key, rule)] = f"{key}{number}"
                self._rules[numbered] = rule
            return numbered

        def _resolve_ref(self, ref: str) -> str:
            key = self._ref_rules.get(ref)
            if key is None:
                base = module.INVALID_RULE_CHARS_RE.sub(
                    "-", ref.rsplit("/", 1)[-1][:_RULE_NAME_CHARS]) or "ref"
                key, number = base, 0
                while key in self._rules or key in module.RESERVED_NAMES:
                    key, number = f"{base}-{number}", number + 1
                # Held while the target is converted: a reference inside it (recursion)
                # names this rule, and no other rule can take the name.
                self._rules[key] = "\x00"
                self._ref_rules[ref] = key
                self._rules[key] = self.visit(self._refs[ref], key)
            return key

        def visit(self, schema: dict[str, Any], name: str) -> Any:
            name = name[:_RULE_NAME_CHARS]
            if schema.get("type") == "integer" and set(schema) & INTEGER_KEYWORDS:
                rule_name = name + "-" if name in module.RESERVED_NAMES else name or "root"
                low, high = integer_bounds(schema)
                return self._add_rule(rule_name, integer_range_gbnf(low, high) + " space")

            if _beyond_converter(schema):
                return self._long_repetition(schema, name)
            return super().visit(schema, name)

        def _visit_pattern(self, pattern: str, name: str) -> str:
            body = pattern_gbnf(pattern[1:-1])
            return self._add_rule(name, f'"\\"" {body} "\\"" space')

        def _build_object_rule(self, properties: list[tuple[str, Any]], required: set[str],
                               name: str, additional: Any) -> str:
            prefix = f"{name}-" if name else ""
            kv_rules: dict[Any, str] = {}
            for prop_name, prop_schema in properties:
                value_rule = self.visit(prop_schema, f"{prefix}{prop_name}")
                kv_rules[prop_name] = self._add_rule(
                    f"{prefix}{prop_name}-kv",
                    f'{self._format_literal(json.dumps(prop_name))} space ":" space '
                    f"{value_rule}")
            names = [prop_name for prop_name, _ in properties]
            required_props = [key for key in names if key in required]
            optional: list[Any] = [key for key in names if key not in required]
            if additional is True or isinstance(additional, dict):
                value_rule = self.visit({} if additional is True else additional,
                                        f"{prefix}additional-value")
                string = self._add_primitive("string", module.PRIMITIVE_RULES["string"])
                kv_rules[_ANY_KEY] = self._add_rule(f"{prefix}additional-kv",
                                                    f'{string} ":" space {value_rule}')
                optional.append(_ANY_KEY)
            rule = '"{" space ' + ' "," space '.join(kv_rules[k] for k in required_props)
            if optional:
                rule += " ("
                if required_props:
                    rule += ' "," space ( '
                rule += " | ".join(self._optional_chains(optional, kv_rules, prefix))
                if required_props:
                    rule += " )"
                rule += " )?"
            return rule + ' "}" space'

        def _optional_chains(self, optional: list[Any], kv_rules: dict[Any, str],
                             prefix: str) -> list[str]:
            """For each optional property, the properties it may be followed by, in
            order, each optional: the stock converter's get_recursive_refs, from the
            last property backwards."""
            def head(key: Any, first: bool) -> str:
                if key is _ANY_KEY:
                    kv = kv_rules[key]
                    return self._add_rule(f"{prefix}additional-kvs",
                                          f'{kv} ( "," space {kv} )*')
                return kv_rules[key] if first else f'( "," space {kv_rules[key]} )?'

            rest = [""] * len(optional)  # rest[i]: the rule for what may follow i
            for i in range(len(optional) - 1, 0, -1):
                text = head(optional[i], first=False)
                if i + 1 < len(optional):
                    text += " " + rest[i]
                label = "*" if optional[i - 1] is _ANY_KEY else optional[i - 1]
                rest[i - 1] = self._add_rule(f"{prefix}{label}-rest", text)
            return [head(key, first=True) + (" " + rest[i] if i + 1 < len(optional) else "")
                    for i, key in enumerate(optional)]

        def _long_repetition(self, schema: dict[str, Any], name: str) -> Any:
            rule_name = name + "-" if name in module.RESERVED_NAMES else name or "root"
            if schema.get("type") == "string":
                char = self._add_primitive("char", module.PRIMITIVE_RULES["char"])
                count = _counted(schema.get("minLength", 0), schema.get("maxLength"))
                return self._add_rule(rule_name, f'"\\"" ({char}){count} "\\"" space')
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            low, high = schema.get("minItems", 0), schema.get("maxItems")
            body = item
            if high is None or high > 1:
                more = _counted(max(low - 1, 0), None if high is None else high - 1)
                body += f' ("," space {item}){more}'
            if low == 0:
                body = f"({body})?"
            if high == 0:
                body = ""
            return self._add_rule(rule_name, f'"[" space {body} "]" space')

        def _add_primitive(self, name: str, rule: Any) -> Any:
            if name == "char":
                rule = module.BuiltinRule(_CHAR_RULE, [])
            return super()._add_primitive(name, rule)

    _class_cache.append(Converter)
    return Converter


def _beyond_converter(schema: dict[str, Any]) -> bool:
    """A string or array bound the converter's nested groups should not be used for."""
    keys = (("minLength", "maxLength") if schema.get("type") == "string"
            else ("minItems", "maxItems") if "items" in schema else ())
    return any(isinstance(schema.get(key), int) and schema[key] > CONVERTER_REPEAT
               for key in keys)


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
