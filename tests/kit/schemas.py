"""Hypothesis strategies of JSON schemas (clean, noisy, one value wrong), and schemas and
grammars past the structural bounds, shared by the schema property tests
(tests/unit/structured/, tests/e2e/llama/ and tests/e2e/ndjson/test_schema_property.py)."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from sfcore_daemon.structured.gbnfcheck import GrammarError

PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


LEAVES = (st.none() | st.booleans() | st.integers(-(10**20), 10**20)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
JSON_VALUES = st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
NAMES = st.sampled_from(["a", "b", "c", "$ref", "string", "space", "root", "x y", "é", "",
                         "*", "a-kv", "0"]) | st.text(max_size=5)
TYPE_NAMES = ["object", "array", "string", "number", "integer", "boolean", "null"]
PATTERN_CHARS = "ab-z09()[]{}|*+?.\\^$,\"é \n"
PATTERNS = (st.text(alphabet=PATTERN_CHARS, max_size=14).map(lambda body: f"^{body}$")
            | st.text(alphabet=PATTERN_CHARS, max_size=14))
REFS = (st.sampled_from(["#/$defs/a", "#/$defs/b", "#/definitions/a", "#/properties/a",
                         "#/items", "#/anyOf/0", "#/", "#/$defs", "#/examples/0",
                         "https://example.org/s.json", "#/$defs/a#b"])
        | st.text(max_size=10).map(lambda path: "#/" + path))
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
KEYWORDS = ["type", "format", "pattern", "$ref", "required", "enum", "const", "title",
            "description", "default", "examples", *SCHEMA_LISTS, *SCHEMA_MAPS,
            *SCHEMA_VALUES, *COUNTS, *BOUNDS, "uniqueItems"]


def _value_for(key: str, depth: int, noisy: bool) -> st.SearchStrategy[Any]:
    """What the keyword takes; in a noisy schema, often something of another type."""
    sub = _schemas(depth + 1, noisy)
    if key in SCHEMA_LISTS:
        right: st.SearchStrategy[Any] = st.lists(sub, min_size=1, max_size=3)
    elif key in SCHEMA_MAPS:
        right = st.dictionaries(NAMES, sub, max_size=3)
    elif key in SCHEMA_VALUES:
        right = sub | st.booleans()
    elif key == "type":
        right = st.sampled_from([*TYPE_NAMES, "strnig"]) | st.lists(
            st.sampled_from(TYPE_NAMES), min_size=1, max_size=3)
    elif key == "format":
        right = st.sampled_from(["date", "time", "date-time", "uuid", "email"])
    elif key == "pattern":
        right = PATTERNS
    elif key == "$ref":
        right = REFS
    elif key == "required":
        right = st.lists(NAMES, max_size=3)
    elif key in COUNTS:
        right = st.integers(-3, 2100) | st.integers(0, 5)
    elif key in BOUNDS:
        right = st.integers(-(10**17), 10**17) | st.floats(-1e18, 1e18) | st.integers(-9, 9)
    elif key == "enum":
        right = st.lists(JSON_VALUES, max_size=4)
    else:
        right = JSON_VALUES
    return st.one_of(right, right, JSON_VALUES) if noisy else right


def _schemas(depth: int, noisy: bool) -> st.SearchStrategy[Any]:
    if depth > 3:
        return st.just({}) | st.fixed_dictionaries({"type": st.sampled_from(TYPE_NAMES)})
    if noisy:
        return st.one_of(_nodes(depth, noisy), _nodes(depth, noisy), JSON_VALUES)
    return _nodes(depth, noisy)


# The keywords a schema of each kind is made of (so that most drawn schemas get past the
# rules on combining keywords, and the values reach the converter); "type" is added or
# not, of the kind or another.
TEMPLATES = {
    "object": ["properties", "required", "additionalProperties"],
    "array": ["items", "minItems", "maxItems", "prefixItems"],
    "string": ["minLength", "maxLength", "pattern", "format"],
    "integer": ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"],
    "values": ["enum", "const"],
    "reference": ["$ref"],
    "union": ["anyOf"],
}
ODD_KEYS = st.sampled_from(["oneOf", "allOf", "not", "uniqueItems", "multipleOf",
                            "patternProperties", "contains", "title", "default", "$comment"]
                           ) | st.text(max_size=4)


@st.composite
def _nodes(draw: st.DrawFn, depth: int, noisy: bool) -> dict[str, Any]:
    kind = draw(st.sampled_from([*TEMPLATES, "type only"]))
    keywords = TEMPLATES.get(kind, [])
    keys = draw(st.lists(st.sampled_from(keywords), max_size=3, unique=True)) if keywords else []
    node = {key: draw(_value_for(key, depth, noisy)) for key in keys}
    if kind not in ("reference", "union", "values") and draw(st.booleans()):
        node["type"] = kind if kind in TYPE_NAMES and draw(st.integers(0, 3)) else draw(
            _value_for("type", depth, noisy))
    if noisy and draw(st.integers(0, 3)) == 0:
        key = draw(ODD_KEYS | st.sampled_from(KEYWORDS))
        node[key] = draw(_value_for(key, depth, noisy))
    return node


# Any JSON value, containers as often as not: what a careless or hostile client puts where
# a keyword's value goes.
WRONG = st.one_of(LEAVES, st.lists(LEAVES, max_size=3),
                  st.dictionaries(st.text(max_size=4), LEAVES, max_size=3), JSON_VALUES)


def places_in(value: Any) -> list[tuple[dict[str, Any], str]]:
    """Every (object, key) in a document, at any depth."""
    places = []
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            places += [(item, key) for key in item]
            todo += item.values()
        elif isinstance(item, list):
            todo += item
    return places


# Valid schemas that use every supported keyword, for one value in them to be replaced.
BASES: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24, "minLength": 1},
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        "score": {"type": "number"}, "ok": {"type": "boolean"}, "none": {"type": "null"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
        "kind": {"enum": ["a", "b", 3]}, "fixed": {"const": {"k": [1, 2]}},
        "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "maybe": {"type": ["string", "null"]},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "closed": {"type": "object", "properties": {"x": {"type": "number"}},
                   "required": ["x"], "additionalProperties": False}},
     "required": ["name", "age"], "title": "person", "description": "d"},
    {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value"]}},
     "$ref": "#/$defs/node"},
    {"definitions": {"leaf": {"type": "string", "format": "time"}},
     "type": "array", "items": {"anyOf": [{"$ref": "#/definitions/leaf"},
                                          {"type": "array", "items": {"type": "boolean"}}]}},
    {"type": "string", "pattern": "^(ab|c[0-9]+)*x?$"},
]


@st.composite
def _documents(draw: st.DrawFn) -> Any:
    """A schema, often with definitions its references can find: clean, noisy, or clean
    but for one value somewhere replaced with any JSON value."""
    mode = draw(st.sampled_from(["clean", "noisy", "one wrong", "base", "base", "base"]))
    if mode == "base":  # mostly a keyword's value, at times a whole schema
        schema = copy.deepcopy(draw(st.sampled_from(BASES)))
        places = places_in(schema)
        if draw(st.integers(0, 3)):
            places = [(owner, key) for owner, key in places if key in KEYWORDS]
        owner, key = places[draw(st.integers(0, len(places) - 1))]
        owner[key] = draw(WRONG)
        return schema
    schema = draw(_schemas(0, mode == "noisy"))
    if mode == "noisy" and draw(st.integers(0, 4)) == 0:
        schema = draw(JSON_VALUES)
    if isinstance(schema, dict) and draw(st.booleans()):
        schema["$defs"] = draw(st.dictionaries(st.sampled_from(["a", "b"]),
                                               _schemas(1, mode == "noisy"),
                                               min_size=1, max_size=2))
    places = places_in(schema)
    if mode == "one wrong" and places:
        owner, key = places[draw(st.integers(0, len(places) - 1))]
        owner[key] = draw(WRONG)
    return schema


SCHEMA_DOCUMENTS = _documents()


def names_a_place(error: GrammarError, field: str) -> None:
    message = str(error)
    assert f"- at `$.{field}" in message, message


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def ref_chain(length: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
            for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def exponential(rules: int) -> str:
    """Two alternatives per rule, each continuing differently: 2**rules first stacks."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= r{i + 1} "x" | r{i + 1} "y"' for i in range(rules)]
    return "\n".join([*lines, f'r{rules} ::= "a"'])
