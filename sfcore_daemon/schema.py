"""JSON Schema to GBNF, on the event loop before a request is queued.

`request_gbnf` turns a request's `json_schema`, `format: "json"` or `grammar` into GBNF
text: a JSON Schema goes through llama-cpp-python's converter after `check_schema` has
refused what the converter would silently get wrong. Every mistake is a `GrammarError`
naming the field, answered as `invalid_request`.
"""

from __future__ import annotations

import importlib
import json
from typing import TYPE_CHECKING, Any, Final

from .grammar import GrammarError, check_gbnf
from .jsonshape import Shape, free_object, integer_bounds, shape_of

if TYPE_CHECKING:
    from .protocol import GenerationRequest


# --- JSON Schema ------------------------------------------------------------------------

# Keywords that assert nothing: accepted anywhere and ignored.
ANNOTATIONS: Final = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
})
TYPES: Final = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
STRING_FORMATS: Final = frozenset({"date", "time", "date-time", "uuid"})
# What the converter turns into grammar, by the kind of schema it applies to.
_OBJECT_KEYWORDS: Final = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYWORDS: Final = frozenset({"items", "minItems", "maxItems", "prefixItems"})
_STRING_KEYWORDS: Final = frozenset({"minLength", "maxLength", "pattern", "format"})
_INTEGER_KEYWORDS: Final = frozenset({"minimum", "maximum", "exclusiveMinimum",
                                      "exclusiveMaximum"})
SUPPORTED_KEYWORDS: Final = (ANNOTATIONS | _OBJECT_KEYWORDS | _ARRAY_KEYWORDS | _STRING_KEYWORDS
                             | _INTEGER_KEYWORDS | {"type", "enum", "const", "anyOf", "$ref"})
# The grammar's integers have at most 16 digits; so must their bounds.
MAX_INTEGER_BOUND: Final = 10**16 - 1
# Bounds of minItems/maxItems and minLength/maxLength. Up to CONVERTER_REPEAT the
# converter writes a repetition as nested groups, one per allowed count (llama.cpp's
# parser recurses into each); past it the grammar says `{m,n}`, which llama.cpp expands
# into a chain of small rules. MAX_REPEAT keeps that chain, which every grammar copy
# (budget.py) duplicates, small.
CONVERTER_REPEAT: Final = 256
MAX_REPEAT: Final = 4096
MAX_SCHEMA_DEPTH: Final = 32

_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,), "array": (list,), "string": (str,), "number": (int, float),
    "integer": (int,), "boolean": (bool,), "null": (type(None),),
}

# JSON string characters: control characters must be escaped, and a \u escape may not
# name half of a surrogate pair (llama-cpp-python's rule allowed both).
_NO_SURROGATE_ESCAPE: Final = r'"u" ([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})'
_CHAR_RULE: Final = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | ' + _NO_SURROGATE_ESCAPE + ")"


def request_gbnf(request: GenerationRequest) -> tuple[str, str] | None:
    """The GBNF text a request asks for and the field it came from, or None when the
    request is unconstrained."""
    given = [name for name in ("json_schema", "format", "grammar")
             if getattr(request, name) is not None]
    if len(given) > 1:
        raise GrammarError(f"json_schema, format and grammar exclude each other; "
                           f"this request gives {' and '.join(given)}")
    if request.json_schema is not None:
        return schema_to_gbnf(request.json_schema), "json_schema"
    if request.format is not None:
        return json_gbnf(), "format"
    if request.grammar is not None:
        check_gbnf(request.grammar)
        return request.grammar, "grammar"
    return None


def request_shape(request: GenerationRequest) -> Shape | None:
    """The JSON document a request's grammar describes, for closing it early when its
    budget runs out (budget.py); None for a GBNF grammar, or a schema the tracker
    cannot follow."""
    try:
        if request.json_schema is not None:
            return shape_of(request.json_schema)
        if request.format is not None:
            return free_object()
    except Exception:  # a schema the converter took: the document is still constrained
        return None
    return None


def json_gbnf() -> str:
    """llama.cpp's json.gbnf (any JSON object), with string escapes as in _CHAR_RULE."""
    text: str = _converter_module().JSON_GBNF
    any_hex = '"u" [0-9a-fA-F]{4}'
    if any_hex in text:
        text = text.replace(any_hex, _NO_SURROGATE_ESCAPE)
    return text


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """GBNF for documents valid against `schema`; GrammarError if it uses a keyword the
    conversion cannot honour."""
    check_schema(schema)
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False,
                                   raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        converter.visit(resolved, "")
        text: str = converter.format_grammar()
    except Exception as exc:  # the converter's own bugs too: the schema is the client's
        raise GrammarError(f"json_schema cannot be converted to a grammar: {exc}"
                           " - at `$.json_schema`") from None
    return text


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse what the converter would ignore or get wrong, naming keyword and place.

    The converter picks one rule per schema ($ref, then anyOf, then a list of types,
    then const, enum, ...) and drops the other keywords of that schema without a word,
    so a combination it would half-honour is refused rather than let through.
    """
    _check(schema, "$.json_schema", schema, 0)


def _check(schema: Any, path: str, root: dict[str, Any], depth: int) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"a schema must be a JSON object (boolean schemas are not "
                           f"supported) - at `{path}`")
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels - at `{path}`")
    for key in schema:
        if key not in SUPPORTED_KEYWORDS:
            raise GrammarError(f"unsupported JSON Schema keyword {key!r} - at `{path}`")
    for key in ("$defs", "definitions"):
        if key in schema:
            defs = schema[key]
            if not isinstance(defs, dict):
                raise GrammarError(f"{key} must be an object - at `{path}.{key}`")
            for name, sub in defs.items():
                _check(sub, f"{path}.{key}.{name}", root, depth + 1)
    asserting = {key for key in schema if key not in ANNOTATIONS}

    def alone(keyword: str) -> None:
        others = sorted(asserting - {keyword})
        if others:
            raise GrammarError(f"{keyword} cannot be combined with {', '.join(others)} "
                               f"(only annotations may stand beside it) - at `{path}`")

    if "$ref" in schema:
        alone("$ref")
        _check_ref(schema["$ref"], f"{path}.$ref", root)
        return
    if "anyOf" in schema:
        alone("anyOf")
        _check_each(schema, "anyOf", path, root, depth)
        return
    kind = schema.get("type")
    if isinstance(kind, list):
        alone("type")
        if not kind or any(not isinstance(t, str) or t not in TYPES for t in kind):
            raise GrammarError(f"type must be one of {sorted(TYPES)} or a non-empty list "
                               f"of them - at `{path}.type`")
        return
    if kind is not None and (not isinstance(kind, str) or kind not in TYPES):
        raise GrammarError(f"type must be one of {sorted(TYPES)} - at `{path}.type`")
    if "const" in schema or "enum" in schema:
        _check_values(schema, kind, path, asserting)
        return
    if kind is None:
        families = [name for name, keys in (("object", _OBJECT_KEYWORDS),
                                            ("array", _ARRAY_KEYWORDS),
                                            ("string", _STRING_KEYWORDS)) if asserting & keys]
        if len(families) > 1:
            raise GrammarError(f"keywords of different types ({' and '.join(families)}) "
                               f"without a type - at `{path}`")
        kind = families[0] if families else None
        if kind == "string" and asserting & {"minLength", "maxLength", "format"}:
            raise GrammarError(f"minLength, maxLength and format need \"type\": \"string\" "
                               f"- at `{path}`")
    bounds = sorted(asserting & _INTEGER_KEYWORDS)
    if bounds and kind != "integer":
        raise GrammarError(f"{bounds[0]} is supported only with \"type\": \"integer\" "
                           f"(number bounds are not enforced) - at `{path}`")
    misplaced = sorted(asserting - {"type"} - _keywords_of(kind))
    if misplaced:
        raise GrammarError(f"keyword {misplaced[0]!r} does not apply to type {kind!r} "
                           f"- at `{path}`")
    if kind == "object":
        _check_object(schema, path, root, depth)
    elif kind == "array":
        _check_array(schema, path, root, depth)
    elif kind == "string":
        _check_string(schema, path)
    elif kind == "integer":
        _check_integer(schema, path)


def _keywords_of(kind: str | None) -> frozenset[str]:
    return {"object": _OBJECT_KEYWORDS, "array": _ARRAY_KEYWORDS,
            "string": _STRING_KEYWORDS, "integer": _INTEGER_KEYWORDS}.get(kind or "",
                                                                         frozenset())


def _check_integer(schema: dict[str, Any], path: str) -> None:
    for key in sorted(set(schema) & _INTEGER_KEYWORDS):
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not -MAX_INTEGER_BOUND <= value <= MAX_INTEGER_BOUND:
            raise GrammarError(f"{key} must be a number from {-MAX_INTEGER_BOUND} to "
                               f"{MAX_INTEGER_BOUND} - at `{path}.{key}`")
    low, high = integer_bounds(schema)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer is within the bounds (minimum above maximum) "
                           f"- at `{path}`")


def _check_ref(ref: Any, path: str, root: dict[str, Any]) -> None:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise GrammarError(f"only local references (\"#/...\") are supported - at `{path}`")
    target: Any = root
    for part in ref[2:].split("/"):  # as the converter reads it: no ~0/~1 escapes
        if not isinstance(target, dict) or part not in target:
            raise GrammarError(f"reference {ref!r} does not resolve - at `{path}`")
        target = target[part]
    if not isinstance(target, dict):
        raise GrammarError(f"reference {ref!r} is not a schema - at `{path}`")


def _check_values(schema: dict[str, Any], kind: str | None, path: str,
                  asserting: set[str]) -> None:
    extra = sorted(asserting - {"type", "const", "enum"})
    if extra or ("const" in schema and "enum" in schema):
        keyword = "const" if "const" in schema else "enum"
        others = sorted(asserting - {keyword, "type"})
        raise GrammarError(f"{keyword} can only be combined with type, not "
                           f"{', '.join(others)} - at `{path}`")
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise GrammarError(f"enum must be a non-empty list - at `{path}.enum`")
    else:
        values = [schema["const"]]
    if kind is not None:
        for value in values:
            if not _is_of_type(value, kind):
                raise GrammarError(f"value {json.dumps(value)} is not of type {kind!r} "
                                   f"- at `{path}`")


def _is_of_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind not in ("boolean",):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[kind])


def _count(schema: dict[str, Any], key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
        raise GrammarError(f"{key} must be an integer from 0 to {MAX_REPEAT} - at `{path}.{key}`")
    return value


def _check_bounds(schema: dict[str, Any], path: str, low_key: str, high_key: str) -> None:
    low, high = _count(schema, low_key, path), _count(schema, high_key, path)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"{low_key} is above {high_key} - at `{path}`")


def _check_object(schema: dict[str, Any], path: str, root: dict[str, Any], depth: int) -> None:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise GrammarError(f"properties must be an object - at `{path}.properties`")
    for name, sub in properties.items():
        _check(sub, f"{path}.properties.{name}", root, depth + 1)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise GrammarError(f"required must be a list of strings - at `{path}.required`")
    for name in required:
        if name not in properties:
            raise GrammarError(f"required property {name!r} is not in properties "
                               f"- at `{path}.required`")
    extra = schema.get("additionalProperties", False)
    if extra is not False:
        if properties:
            # Free keys could repeat a declared one with a value of another type.
            raise GrammarError("additionalProperties other than false is supported only in "
                               f"an object without properties - at `{path}`")
        if extra is not True:
            _check(extra, f"{path}.additionalProperties", root, depth + 1)


def _check_each(schema: dict[str, Any], key: str, path: str, root: dict[str, Any],
                depth: int) -> None:
    """`schema[key]` must be a non-empty list of schemas; check each."""
    subschemas = schema[key]
    if not isinstance(subschemas, list) or not subschemas:
        raise GrammarError(f"{key} must be a non-empty list - at `{path}.{key}`")
    for i, sub in enumerate(subschemas):
        _check(sub, f"{path}.{key}[{i}]", root, depth + 1)


def _check_array(schema: dict[str, Any], path: str, root: dict[str, Any], depth: int) -> None:
    if "prefixItems" in schema:
        others = sorted(set(schema) & {"items", "minItems", "maxItems"})
        if others:
            raise GrammarError(f"prefixItems cannot be combined with {', '.join(others)} "
                               f"- at `{path}`")
        _check_each(schema, "prefixItems", path, root, depth)
        return
    if "items" not in schema:
        if "minItems" in schema or "maxItems" in schema:
            raise GrammarError(f"minItems and maxItems need items - at `{path}`")
        return
    if isinstance(schema["items"], list):
        raise GrammarError(f"items must be a schema (use prefixItems for tuples) "
                           f"- at `{path}.items`")
    _check(schema["items"], f"{path}.items", root, depth + 1)
    _check_bounds(schema, path, "minItems", "maxItems")


def _check_string(schema: dict[str, Any], path: str) -> None:
    present = sorted(set(schema) & _STRING_KEYWORDS)
    groups = [bool(set(present) & {"minLength", "maxLength"}), "pattern" in present,
              "format" in present]
    if sum(groups) > 1:
        raise GrammarError(f"{', '.join(present)} cannot be combined - at `{path}`")
    _check_bounds(schema, path, "minLength", "maxLength")
    if "format" in schema and schema["format"] not in STRING_FORMATS:
        raise GrammarError(f"unsupported string format {schema['format']!r} (supported: "
                           f"{', '.join(sorted(STRING_FORMATS))}) - at `{path}.format`")
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str) or not (pattern.startswith("^")
                                                and pattern.endswith("$")):
            raise GrammarError(f"pattern must be anchored (start with ^ and end with $) "
                               f"- at `{path}.pattern`")
        _check_pattern(pattern[1:-1], f"{path}.pattern")


# Regex escapes the converter turns into the plain character (outside brackets).
_PATTERN_ESCAPES: Final = frozenset("()[]{}|*+?")
# Characters a JSON string may not hold raw: a pattern that can produce one would make
# the converter's grammar write invalid JSON.
_JSON_UNSAFE: Final = frozenset('"\\\x7f') | frozenset(map(chr, range(0x20)))


def _check_pattern(body: str, path: str) -> None:
    """Accept what converts to GBNF that stays inside a JSON string: literals, positive
    [classes] and ranges, groups, alternatives and quantifiers; no `.`, no [^negated]
    class, no character a JSON string must escape."""
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            escaped = body[i + 1:i + 2]
            if escaped not in _PATTERN_ESCAPES or not escaped:
                raise GrammarError(f"pattern escape {body[i:i + 2]!r} is not supported (write "
                                   f"a class such as [0-9] or [.]) - at `{path}`")
            i += 2
            continue
        if char == "[":
            end = body.find("]", i + 1)
            if end < 0:
                raise GrammarError(f"unbalanced [ in pattern - at `{path}`")
            members = body[i + 1:end]
            if members.startswith("^") or "\\" in members or not members:
                raise GrammarError(f"pattern class [{members}] is not supported (no negated "
                                   f"classes, no escapes inside brackets) - at `{path}`")
            low = 0
            while low < len(members):
                if low + 2 < len(members) and members[low + 1] == "-":
                    first, last = ord(members[low]), ord(members[low + 2])
                    low += 3
                else:
                    first = last = ord(members[low])
                    low += 1
                if any(first <= ord(unsafe) <= last for unsafe in _JSON_UNSAFE):
                    raise GrammarError(f"pattern class [{members}] includes characters a JSON "
                                       f"string must escape - at `{path}`")
            i = end + 1
            continue
        if char == ".":
            raise GrammarError(f"pattern '.' is not supported (write a class such as "
                               f"[a-zA-Z0-9 ]) - at `{path}`")
        if char == "(" and body[i + 1:i + 2] == "?":
            raise GrammarError(f"pattern groups with (? are not supported - at `{path}`")
        if char in _JSON_UNSAFE:
            raise GrammarError(f"pattern character {char!r} must be escaped in JSON and is "
                               f"not supported - at `{path}`")
        i += 1

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


def _converter_class() -> Any:
    if _class_cache:
        return _class_cache[0]
    module = _converter_module()

    class Converter(module.SchemaConverter):  # type: ignore[misc,name-defined]
        """The stock converter with two fixes: literals escape backslashes (enum values
        such as "a\\\\b" broke the grammar), and string characters follow JSON (no raw
        control characters, no lone surrogate escapes)."""

        def _format_literal(self, literal: str) -> str:
            escaped = (literal.replace("\\", "\\\\").replace('"', '\\"')
                       .replace("\r", "\\r").replace("\n", "\\n"))
            return f'"{escaped}"'

        def _generate_constant_rule(self, value: Any) -> str:
            # Non-ASCII text as itself rather than as \\u escapes: the form a model writes.
            return self._format_literal(json.dumps(value, ensure_ascii=False))

        def visit(self, schema: dict[str, Any], name: str) -> Any:
            if schema.get("type") == "integer" and set(schema) & _INTEGER_KEYWORDS:
                rule_name = name + "-" if name in module.RESERVED_NAMES else name or "root"
                low, high = integer_bounds(schema)
                return self._add_rule(rule_name, integer_range_gbnf(low, high) + " space")

            if _beyond_converter(schema):
                return self._long_repetition(schema, name)
            return super().visit(schema, name)

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
