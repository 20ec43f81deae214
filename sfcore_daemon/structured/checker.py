"""A client's JSON Schema, checked and rewritten into the form the grammar is made from.

`check_schema` is the one reader of a schema as the client sent it. Any JSON value may
stand anywhere in it, so every keyword's value is read through a typed accessor that
refuses a wrong type with a `GrammarError` naming the place (`$.json_schema.properties
.a.format`). What it returns, a `CheckedSchema`, is all the shape builder (shape.py)
ever sees, and the grammar is written from the shapes (gbnf.py): only the keywords
they act on, each of the type they expect, the type written out where the keywords
implied it, annotations dropped, and each `$ref` resolved once. Unlike the raw schema,
it holds nothing they could trip on.

The shape builder picks one reading per schema ($ref, then anyOf, then a list of types,
then const, enum, ...), as llama.cpp's json-schema-to-grammar converter does, and would
drop the other keywords of that schema without a word, so a combination it would
half-honour is refused rather than let through.
"""

from __future__ import annotations

import json
from typing import Any, Final

from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_REPEAT, GrammarError
from sfcore_daemon.structured.pattern import check_pattern
from sfcore_daemon.structured.shape import integer_bounds

# Keywords that assert nothing: accepted anywhere and ignored.
ANNOTATIONS: Final = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
})
TYPES: Final = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
STRING_FORMATS: Final = frozenset({"date", "time", "date-time", "uuid"})
# What the grammar honours, by the kind of schema it applies to.
OBJECT_KEYWORDS: Final = frozenset({"properties", "required", "additionalProperties"})
ARRAY_KEYWORDS: Final = frozenset({"items", "minItems", "maxItems", "prefixItems"})
STRING_KEYWORDS: Final = frozenset({"minLength", "maxLength", "pattern", "format"})
INTEGER_KEYWORDS: Final = frozenset({"minimum", "maximum", "exclusiveMinimum",
                                     "exclusiveMaximum"})
SUPPORTED_KEYWORDS: Final = (ANNOTATIONS | OBJECT_KEYWORDS | ARRAY_KEYWORDS | STRING_KEYWORDS
                             | INTEGER_KEYWORDS | {"type", "enum", "const", "anyOf", "$ref"})
# The grammar's integers have at most 16 digits; so must their bounds.
MAX_INTEGER_BOUND: Final = 10**16 - 1
# Bounds of minItems/maxItems and minLength/maxLength: llama.cpp's repetition limit
# (above it llama.cpp would make a bound unbounded).
MAX_REPEAT: Final = MAX_GRAMMAR_REPEAT
MAX_SCHEMA_DEPTH: Final = 32
# Nesting counted through $refs (a recursive cycle's schemas once each), since the shape
# builder and the grammar's writer recurse along such chains.
MAX_REF_DEPTH: Final = 128
# How deep a const or enum value may nest (its literal is written with json.dumps).
MAX_VALUE_DEPTH: Final = 64

_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,), "array": (list,), "string": (str,), "number": (int, float),
    "integer": (int,), "boolean": (bool,), "null": (type(None),),
}
_KEYWORDS_OF: Final = {"object": OBJECT_KEYWORDS, "array": ARRAY_KEYWORDS,
                       "string": STRING_KEYWORDS, "integer": INTEGER_KEYWORDS}


class CheckedSchema:
    """A checked schema: `root`, and `refs`, each `$ref` string in it with the checked
    schema it refers to (a target shared by several references is one object)."""

    __slots__ = ("refs", "root")

    def __init__(self, root: dict[str, Any], refs: dict[str, dict[str, Any]]) -> None:
        self.root = root
        self.refs = refs


def check_schema(schema: Any) -> CheckedSchema:
    """The checked form of a client's schema; GrammarError naming the place of the first
    thing the conversion cannot honour."""
    return _Checker(schema).run()


class _Checker:
    def __init__(self, root: Any) -> None:
        self._root = root
        self._done: dict[int, dict[str, Any]] = {}  # id(raw schema) -> its checked form
        self._refs: dict[str, dict[str, Any]] = {}
        self._seen_refs: set[str] = set()
        self._pending: list[tuple[str, Any, str]] = []  # (ref, target, its path)

    def run(self) -> CheckedSchema:
        root = self._schema(self._root, "$.json_schema", 0)
        while self._pending:
            ref, target, path = self._pending.pop()
            self._refs[ref] = self._schema(target, path, 0)
        if self._refs:
            _check_ref_depth(root, self._refs)
        return CheckedSchema(root, self._refs)

    def _schema(self, schema: Any, path: str, depth: int) -> dict[str, Any]:
        if not isinstance(schema, dict):
            raise GrammarError(f"a schema must be a JSON object (boolean schemas are not "
                               f"supported) - at `{path}`")
        done = self._done.get(id(schema))
        if done is not None:
            return done
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels "
                               f"- at `{path}`")
        for key in schema:
            if key not in SUPPORTED_KEYWORDS:
                raise GrammarError(f"unsupported JSON Schema keyword {key!r} - at `{path}`")
        for key in ("$defs", "definitions"):
            if key in schema:
                for name, sub in _mapping(schema, key, path).items():
                    self._schema(sub, f"{path}.{key}.{name}", depth + 1)
        checked = self._assertions(schema, path, depth)
        self._done[id(schema)] = checked
        return checked

    def _assertions(self, schema: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        asserting = {key for key in schema if key not in ANNOTATIONS}

        def alone(keyword: str) -> None:
            others = sorted(asserting - {keyword})
            if others:
                raise GrammarError(f"{keyword} cannot be combined with {', '.join(others)} "
                                   f"(only annotations may stand beside it) - at `{path}`")

        if "$ref" in schema:
            alone("$ref")
            return {"$ref": self._ref(schema["$ref"], f"{path}.$ref")}
        if "anyOf" in schema:
            alone("anyOf")
            return {"anyOf": self._each(schema, "anyOf", path, depth)}
        kind = schema.get("type")
        if isinstance(kind, list):
            alone("type")
            if not kind or any(not isinstance(t, str) or t not in TYPES for t in kind):
                raise GrammarError(f"type must be one of {sorted(TYPES)} or a non-empty list "
                                   f"of them - at `{path}.type`")
            return {"type": list(kind)}
        if "type" in schema and (not isinstance(kind, str) or kind not in TYPES):
            raise GrammarError(f"type must be one of {sorted(TYPES)} - at `{path}.type`")
        if "const" in schema or "enum" in schema:
            return _values(schema, kind, path, asserting)
        if kind is None:
            families = [name for name, keys in (("object", OBJECT_KEYWORDS),
                                                ("array", ARRAY_KEYWORDS),
                                                ("string", STRING_KEYWORDS)) if asserting & keys]
            if len(families) > 1:
                raise GrammarError(f"keywords of different types ({' and '.join(families)}) "
                                   f"without a type - at `{path}`")
            kind = families[0] if families else None
            if kind == "string" and asserting & {"minLength", "maxLength", "format"}:
                raise GrammarError(f"minLength, maxLength and format need \"type\": \"string\" "
                                   f"- at `{path}`")
        bounds = sorted(asserting & INTEGER_KEYWORDS)
        if bounds and kind != "integer":
            raise GrammarError(f"{bounds[0]} is supported only with \"type\": \"integer\" "
                               f"(number bounds are not enforced) - at `{path}`")
        misplaced = sorted(asserting - {"type"} - _KEYWORDS_OF.get(kind or "", frozenset()))
        if misplaced:
            raise GrammarError(f"keyword {misplaced[0]!r} does not apply to type {kind!r} "
                               f"- at `{path}`")
        if kind == "object":
            return self._object(schema, path, depth)
        if kind == "array":
            return self._array(schema, path, depth)
        if kind == "string":
            return _string(schema, path)
        if kind == "integer":
            return _integer(schema, path)
        # A schema that asserts nothing is any object (llama.cpp's converter's rule for
        # {}); written out, as the converter read an empty items schema as absent.
        return {"type": kind or "object"}

    def _ref(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise GrammarError(f"only local references (\"#/...\") are supported - at `{path}`")
        if ref in self._seen_refs:
            return ref
        target: Any = self._root
        for part in ref[2:].split("/"):  # as llama.cpp's converter read it: no ~0/~1 escapes
            if not isinstance(target, dict) or part not in target:
                raise GrammarError(f"reference {ref!r} does not resolve - at `{path}`")
            target = target[part]
        if not isinstance(target, dict):
            raise GrammarError(f"reference {ref!r} is not a schema - at `{path}`")
        target_path = "$.json_schema." + ".".join(ref[2:].split("/"))
        self._pending.append((ref, target, target_path))
        self._seen_refs.add(ref)
        return ref

    def _each(self, schema: dict[str, Any], key: str, path: str,
              depth: int) -> list[dict[str, Any]]:
        """`schema[key]` must be a non-empty list of schemas: their checked forms."""
        subschemas = schema[key]
        if not isinstance(subschemas, list) or not subschemas:
            raise GrammarError(f"{key} must be a non-empty list - at `{path}.{key}`")
        return [self._schema(sub, f"{path}.{key}[{i}]", depth + 1)
                for i, sub in enumerate(subschemas)]

    def _object(self, schema: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        checked: dict[str, Any] = {"type": "object"}
        properties = _mapping(schema, "properties", path) if "properties" in schema else {}
        if "properties" in schema:
            checked["properties"] = {
                name: self._schema(sub, f"{path}.properties.{name}", depth + 1)
                for name, sub in properties.items()}
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(f"required must be a list of strings - at `{path}.required`")
        for name in required:
            if name not in properties:
                raise GrammarError(f"required property {name!r} is not in properties "
                                   f"- at `{path}.required`")
        if required:
            checked["required"] = list(required)
        if "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            if extra is not False and properties:
                # Free keys could repeat a declared one with a value of another type.
                raise GrammarError("additionalProperties other than false is supported only "
                                   f"in an object without properties - at `{path}`")
            if isinstance(extra, bool):
                checked["additionalProperties"] = extra
            else:
                checked["additionalProperties"] = self._schema(
                    extra, f"{path}.additionalProperties", depth + 1)
        return checked

    def _array(self, schema: dict[str, Any], path: str, depth: int) -> dict[str, Any]:
        if "prefixItems" in schema:
            others = sorted(set(schema) & {"items", "minItems", "maxItems"})
            if others:
                raise GrammarError(f"prefixItems cannot be combined with {', '.join(others)} "
                                   f"- at `{path}`")
            return {"type": "array", "prefixItems": self._each(schema, "prefixItems", path,
                                                               depth)}
        if "items" not in schema:
            if "minItems" in schema or "maxItems" in schema:
                raise GrammarError(f"minItems and maxItems need items - at `{path}`")
            return {"type": "array"}
        if isinstance(schema["items"], list):
            raise GrammarError(f"items must be a schema (use prefixItems for tuples) "
                               f"- at `{path}.items`")
        checked: dict[str, Any] = {
            "type": "array", "items": self._schema(schema["items"], f"{path}.items", depth + 1)}
        checked.update(_bounds(schema, path, "minItems", "maxItems"))
        return checked


def _mapping(schema: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = schema[key]
    if not isinstance(value, dict):
        raise GrammarError(f"{key} must be an object - at `{path}.{key}`")
    return value


def _values(schema: dict[str, Any], kind: str | None, path: str,
            asserting: set[str]) -> dict[str, Any]:
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
        where = f"{path}.enum"
    else:
        values = [schema["const"]]
        where = f"{path}.const"
    for value in values:
        _check_value_depth(value, where)
        if kind is not None and not _is_of_type(value, kind):
            raise GrammarError(f"value {_shown(json.dumps(value))} is not of type {kind!r} "
                               f"- at `{path}`")
    return {"enum": list(values)} if "enum" in schema else {"const": schema["const"]}


def _check_value_depth(value: Any, path: str) -> None:
    """Walked without recursion: a value may nest as deep as the request decoder allows."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict | list):
            if depth > MAX_VALUE_DEPTH:
                raise GrammarError(f"value nested deeper than {MAX_VALUE_DEPTH} levels "
                                   f"- at `{path}`")
            children = item.values() if isinstance(item, dict) else item
            todo.extend((child, depth + 1) for child in children)


def _shown(text: str) -> str:
    """A client's value in a message, cut short."""
    return text if len(text) <= 80 else text[:77] + "..."


def _is_of_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind != "boolean":
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[kind])


def _count(schema: dict[str, Any], key: str, path: str) -> int | None:
    if key not in schema:
        return None
    value = schema[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
        raise GrammarError(f"{key} must be an integer from 0 to {MAX_REPEAT} - at `{path}.{key}`")
    return value


def _bounds(schema: dict[str, Any], path: str, low_key: str, high_key: str) -> dict[str, int]:
    low, high = _count(schema, low_key, path), _count(schema, high_key, path)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"{low_key} is above {high_key} - at `{path}`")
    return {key: value for key, value in ((low_key, low), (high_key, high))
            if value is not None}


def _integer(schema: dict[str, Any], path: str) -> dict[str, Any]:
    checked: dict[str, Any] = {"type": "integer"}
    for key in sorted(set(schema) & INTEGER_KEYWORDS):
        value = schema[key]
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not -MAX_INTEGER_BOUND <= value <= MAX_INTEGER_BOUND:
            raise GrammarError(f"{key} must be a number from {-MAX_INTEGER_BOUND} to "
                               f"{MAX_INTEGER_BOUND} - at `{path}.{key}`")
        checked[key] = value
    low, high = integer_bounds(checked)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"no integer is within the bounds (minimum above maximum) "
                           f"- at `{path}`")
    return checked


def _string(schema: dict[str, Any], path: str) -> dict[str, Any]:
    present = sorted(set(schema) & STRING_KEYWORDS)
    groups = [bool(set(present) & {"minLength", "maxLength"}), "pattern" in present,
              "format" in present]
    if sum(groups) > 1:
        raise GrammarError(f"{', '.join(present)} cannot be combined - at `{path}`")
    checked: dict[str, Any] = {"type": "string"}
    checked.update(_bounds(schema, path, "minLength", "maxLength"))
    if "format" in schema:
        value = schema["format"]
        if not isinstance(value, str) or value not in STRING_FORMATS:
            raise GrammarError(f"unsupported string format {_shown(repr(value))} (supported: "
                               f"{', '.join(sorted(STRING_FORMATS))}) - at `{path}.format`")
        checked["format"] = value
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str) or not (len(pattern) >= 2 and pattern.startswith("^")
                                                and pattern.endswith("$")):
            raise GrammarError(f"pattern must be anchored (start with ^ and end with $) "
                               f"- at `{path}.pattern`")
        check_pattern(pattern[1:-1], f"{path}.pattern")
        checked["pattern"] = pattern
    return checked


def _check_ref_depth(root: dict[str, Any], refs: dict[str, dict[str, Any]]) -> None:
    """Refuse a schema deeper than MAX_REF_DEPTH along any chain of references.

    The checked schemas form a graph (children, and each $ref to its target). Along a
    path a walker visits each schema at most once (it cuts cycles), so the deepest it
    can go from a schema is bounded by the schemas of its strongly connected component
    plus the deepest of the components below: computed with Tarjan's algorithm, without
    recursion.
    """
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    height: dict[int, int] = {}  # id -> bound, once its component is closed
    stack: list[dict[str, Any]] = []
    on_stack: set[int] = set()
    work: list[tuple[dict[str, Any], list[dict[str, Any]], int]] = []

    def visit(node: dict[str, Any]) -> None:
        index[id(node)] = low[id(node)] = len(index)
        stack.append(node)
        on_stack.add(id(node))
        work.append((node, _children(node, refs), 0))

    visit(root)
    while work:
        node, children, position = work[-1]
        if position < len(children):
            work[-1] = (node, children, position + 1)
            child = children[position]
            if id(child) not in index:
                visit(child)
            elif id(child) in on_stack:
                low[id(node)] = min(low[id(node)], index[id(child)])
            continue
        work.pop()
        if work:
            parent = work[-1][0]
            low[id(parent)] = min(low[id(parent)], low[id(node)])
        if low[id(node)] != index[id(node)]:
            continue
        component = []
        while True:
            member = stack.pop()
            on_stack.discard(id(member))
            component.append(member)
            if member is node:
                break
        members = {id(member) for member in component}
        below = max((height[id(child)] for member in component
                     for child in _children(member, refs) if id(child) not in members),
                    default=0)
        bound = len(component) + below
        if bound > MAX_REF_DEPTH:
            raise GrammarError(f"schema nested deeper than {MAX_REF_DEPTH} levels counting "
                               f"through $ref - at `$.json_schema`")
        for member in component:
            height[id(member)] = bound


def _children(node: dict[str, Any], refs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The schemas directly inside a checked schema, and the target of its $ref."""
    if "$ref" in node:
        return [refs[node["$ref"]]]
    children = list(node.get("anyOf", ())) + list(node.get("prefixItems", ()))
    children += node.get("properties", {}).values()
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            children.append(node[key])
    return children
