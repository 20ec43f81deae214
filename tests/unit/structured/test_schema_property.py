"""Any JSON value where a schema keyword expects a string, a number, a list or an object,
and any text as GBNF: the checks answer with a GrammarError naming the field (an
`invalid_request`), or what they let through converts, parses in llama.cpp and closes;
never another exception. Properties first (hypothesis, bounded), then examples, then the
same through the real daemon.

This file holds the tests that need no daemon and no model; those of llama.cpp and the
real model in-process in tests/e2e/llama/test_schema_property.py; those against the real
daemon in tests/e2e/ndjson/test_schema_property.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.core.admission import request_grammar
from sfcore_daemon.core.request import GenerateRequest
from sfcore_daemon.structured.compiler import compile_schema, schema_to_gbnf
from sfcore_daemon.structured.gbnf import shape_gbnf
from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_BRANCHES, GrammarError, check_gbnf
from sfcore_daemon.structured.tracker import JsonTracker
from tests.kit.gbnf import accepts

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


def _places(value: Any) -> list[tuple[dict[str, Any], str]]:
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
        places = _places(schema)
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
    places = _places(schema)
    if mode == "one wrong" and places:
        owner, key = places[draw(st.integers(0, len(places) - 1))]
        owner[key] = draw(WRONG)
    return schema


SCHEMA_DOCUMENTS = _documents()


def _names_a_place(error: GrammarError, field: str) -> None:
    message = str(error)
    assert f"- at `$.{field}" in message, message


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(KEYWORDS), JSON_VALUES, max_size=4) | SCHEMA_DOCUMENTS)
def test_the_request_path_answers_a_grammar_or_an_invalid_request(schema: Any) -> None:
    if not isinstance(schema, dict):
        return  # the request decoder refuses a json_schema that is not an object
    try:
        spec = request_grammar(GenerateRequest(prompt="x", json_schema=schema))
    except GrammarError as error:
        _names_a_place(error, "json_schema")
        return
    assert spec is not None and spec.field == "json_schema" and spec.shape is not None


@PROPERTY_SETTINGS
@given(SCHEMA_DOCUMENTS)
def test_the_grammar_is_written_from_the_shape_and_accepts_its_shortest_document(
        schema: Any) -> None:
    """A schema is walked once, into its shape: the GBNF is a function of the shape alone
    (written again from it, the same text), and the document the closer completes a fresh
    value with, the shape's shortest, is one the grammar accepts."""
    try:
        compiled = compile_schema(schema)
    except GrammarError:
        return
    assert shape_gbnf(compiled.shape) == compiled.gbnf
    shortest = compiled.shape.shortest
    if len(shortest) < 4000:  # past it: infinite (a $ref cycle), or slow to match
        assert accepts(compiled.gbnf, shortest.decode()), (shortest, compiled.gbnf)


@pytest.mark.parametrize(("schema", "document"), [
    # The converter read `true` here as {} (any object); the shape used to say "{}" only.
    ({"type": "object", "properties": {}, "additionalProperties": True},
     '{"k": {"a": [1, "x"]}, "l": {}}'),
    ({"type": "object", "additionalProperties": {"type": "integer", "minimum": 3}},
     '{"a": 3, "b": 40}'),
    ({"type": "string", "format": "date-time"}, '"2024-02-29T23:59:59.123+05:30"'),
    ({"type": "string", "format": "uuid"}, '"123e4567-E89B-12d3-a456-426614174000"'),
    ({"type": ["boolean", "null", "integer"]}, "null "),
    ({"enum": ["a\\b", {"k": "é"}, None]}, '{"k": "é"}'),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}, '{"c": [{}, {"c": [{"c": []}]}]}'),
    ({"type": "array", "items": {"type": "string", "maxLength": 300}, "minItems": 2,
      "maxItems": 300}, '["ab", "' + "x" * 300 + '"]'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                       "c": {"type": "null"}}, "required": ["b"]},
     '{"b": "", "a": -12, "c": null}'),
])
def test_documents_the_grammar_accepts_are_followed_by_the_shape(schema: dict[str, Any],
                                                                 document: str) -> None:
    compiled = compile_schema(schema)
    assert accepts(compiled.gbnf, document), compiled.gbnf
    assert not accepts(compiled.gbnf, document[:-2]), compiled.gbnf
    tracker = JsonTracker(compiled.shape)
    tracker.feed(document.encode())
    assert not tracker.lost and tracker.completions()[:1] == [b""], document


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _ref_chain(length: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
            for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _exponential(rules: int) -> str:
    """Two alternatives per rule, each continuing differently: 2**rules first stacks."""
    lines = ["root ::= r0"]
    lines += [f'r{i} ::= r{i + 1} "x" | r{i + 1} "y"' for i in range(rules)]
    return "\n".join([*lines, f'r{rules} ::= "a"'])


BAD_SCHEMAS = [
    ({"type": "string", "format": ["date"]}, "unsupported string format ['date']",
     "$.json_schema.format"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": {"x": 1}}}},
     "unsupported string format", "$.json_schema.properties.a.format"),
    ({"type": "string", "pattern": 7}, "pattern must be anchored", "$.json_schema.pattern"),
    ({"type": "string", "pattern": "^]$"}, "must be escaped", "$.json_schema.pattern"),
    ({"type": "string", "pattern": "^a{2,1}$"}, "minimum above", "$.json_schema.pattern"),
    ({"type": "string", "pattern": "^(a?)*$"}, "can be empty", "$.json_schema.pattern"),
    ({"type": "string", "minLength": "3"}, "minLength must be an integer",
     "$.json_schema.minLength"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2001},
     "maxItems must be an integer from 0 to 2000", "$.json_schema.maxItems"),
    ({"type": ["string", 3]}, "type must be one of", "$.json_schema.type"),
    ({"type": {"x": 1}}, "type must be one of", "$.json_schema.type"),
    ({"enum": {"a": 1}}, "enum must be a non-empty list", "$.json_schema.enum"),
    ({"properties": []}, "properties must be an object", "$.json_schema.properties"),
    ({"$defs": [1]}, "$defs must be an object", "$.json_schema.$defs"),
    ({"$ref": ["#/a"]}, "only local references", "$.json_schema.$ref"),
    ({"$ref": "#/default", "default": {"type": 5}}, "type must be one of",
     "$.json_schema.default.type"),
    ({"required": [1]}, "required must be a list of strings", "$.json_schema.required"),
    ({"type": "object", "additionalProperties": 3}, "a schema must be a JSON object",
     "$.json_schema.additionalProperties"),
    ({"anyOf": {"type": "string"}}, "anyOf must be a non-empty list", "$.json_schema.anyOf"),
    ({"type": "integer", "minimum": [0]}, "minimum must be a number",
     "$.json_schema.minimum"),
    ({"enum": [_nested(100)]}, "value nested deeper than 64", "$.json_schema.enum"),
    ({"const": _nested(900)}, "value nested deeper than 64", "$.json_schema.const"),
    (_ref_chain(200), "deeper than 128 levels counting through $ref", "$.json_schema"),
    ({"enum": [f"v{i}" for i in range(5000)]}, "too wide", "$.json_schema"),
]


@pytest.mark.parametrize(("schema", "fragment", "place"), BAD_SCHEMAS)
def test_wrong_types_and_shapes_in_a_schema_are_refused_naming_the_place(
        schema: dict[str, Any], fragment: str, place: str) -> None:
    with pytest.raises(GrammarError) as caught:
        schema_to_gbnf(schema)
    message = str(caught.value)
    assert fragment in message and f"- at `{place}`" in message, message


def test_a_reference_named_like_a_builtin_rule_gets_a_rule_of_its_own() -> None:
    schema = {"$defs": {"string": {"type": "integer"}}, "type": "object",
              "properties": {"t": {"type": "string"}, "s": {"$ref": "#/$defs/string"}},
              "required": ["t", "s"]}
    rules = dict(line.split(" ::= ", 1) for line in schema_to_gbnf(schema).splitlines())
    target = rules[rules["s-kv"].rsplit(" ", 1)[-1]]
    while target in rules:  # follow the aliases to the rule itself
        target = rules[target]
    assert "integral-part" in target and '"\\""' not in target, rules


def test_an_alternation_in_a_pattern_stays_inside_the_string() -> None:
    text = schema_to_gbnf({"type": "string", "pattern": "^a|b$"})
    assert 'root ::= "\\"" ("a" | "b") "\\"" space' in text, text


@pytest.mark.parametrize(("text", "fragment"), [
    ('root ::= "a"{5,2}', "minimum is above its maximum"),  # llama.cpp: endless loop
    ('root ::= b root "x" | "z"\nb ::= "b"?', "left recursion"),  # llama.cpp: bad_alloc
    ("root ::= [a-z]{0,2001}", "at most 2000"),  # llama.cpp: silently unbounded
    ('root ::= "a"{1999}{1999}', "elements"),
    ("root ::= " + " ".join(f'"{"a" * 200}"{{2000}}' for _ in range(5)), "elements"),
    ("\n".join(["root ::= r0", *(f"r{i} ::= r{i + 1}" for i in range(40000)), 'r40000 ::= "a"']),
     "rules"),
    (_exponential(13), f"more than {MAX_GRAMMAR_BRANCHES}"),
    ("root ::= " + " | ".join(f'"{i}"' for i in range(5000)), "too wide"),
    ("root ::= " + "(" * 65 + '"a"' + ")" * 65, "deeper than 64"),
    ('root ::= "a" | \x00', "NUL"),
])
def test_grammars_past_the_structural_bounds_are_refused_before_llama_cpp(
        text: str, fragment: str) -> None:
    with pytest.raises(GrammarError) as caught:
        check_gbnf(text)
    message = str(caught.value)
    assert fragment in message and message.endswith("- at `$.grammar`"), message
