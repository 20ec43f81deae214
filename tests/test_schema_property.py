"""Any JSON value where a schema keyword expects a string, a number, a list or an object,
and any text as GBNF: the checks answer with a GrammarError naming the field (an
`invalid_request`), or what they let through converts, parses in llama.cpp and closes;
never another exception. Properties first (hypothesis, bounded), then examples, then the
same through the real daemon."""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.core.admission import request_grammar
from sfcore_daemon.core.request import GenerateRequest
from sfcore_daemon.structured.checker import check_schema
from sfcore_daemon.structured.compiler import checked_to_gbnf, compile_schema, schema_to_gbnf
from sfcore_daemon.structured.gbnf import shape_gbnf
from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_BRANCHES, GrammarError, check_gbnf
from sfcore_daemon.structured.pattern import check_pattern, pattern_gbnf
from sfcore_daemon.structured.shape import shape_of
from sfcore_daemon.structured.tracker import JsonTracker
from tests.gbnf_match import accepts
from tests.harness import done_of, running_daemon
from tests.llama_grammar_probe import GrammarProbe

PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def probe() -> Iterator[GrammarProbe]:
    grammar_probe = GrammarProbe()
    yield grammar_probe
    grammar_probe.close()


# --- strategies ------------------------------------------------------------------------

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
RULE_NAMES = ["root", "a", "b", "c-d"]


@st.composite
def _gbnf(draw: st.DrawFn) -> str:
    """Text shaped like GBNF (rules of alternatives of repeated atoms), at times with a
    mistake."""
    noisy = draw(st.integers(0, 3)) == 0
    atoms = st.sampled_from(['"a"', '"ab"', "[a-z]", "[^\"]", ".", "<[5]>",
                             '"\\x41"', '"\\u00e9"', *RULE_NAMES, *RULE_NAMES])
    if noisy:
        atoms |= st.sampled_from(['""', "[]", '"\\q"', "undefined", "(", ")", "|", "::=", "#c\n",
                                  "x_y", "{"])
    groups = st.recursive(atoms, lambda inner: st.lists(
        st.lists(inner, max_size=3).map(" ".join), min_size=1, max_size=3).map(
        lambda alts: "(" + " | ".join(alts) + ")"), max_leaves=6)
    quantifiers = st.sampled_from(["", "", "", "", "*", "+", "?", "{2}", "{0,3}", "{2,}",
                                   "{0,12}", "{ 1 , 2 }"])
    if noisy:
        quantifiers |= st.sampled_from(["{5,2}", "{3000}", "{ 1 ,\n2 }"])
    items = st.tuples(groups, quantifiers).map("".join)
    sequences = st.lists(items, min_size=1, max_size=4).map(" ".join)
    bodies = st.lists(sequences, min_size=1, max_size=3).map(" | ".join)
    names = RULE_NAMES + draw(st.lists(st.sampled_from(RULE_NAMES), max_size=2))
    endings = st.sampled_from(["\n", "\n", "\r\n", "\n\n", " # note\n"])
    text = "".join(f"{name} ::= {draw(bodies)}{draw(endings)}" for name in names)
    if noisy and draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=3)) + text[cut:]
    return text


GBNF_TEXTS = st.one_of(_gbnf(), _gbnf(), _gbnf(), st.text(max_size=40))


# --- properties --------------------------------------------------------------------------


def _names_a_place(error: GrammarError, field: str) -> None:
    message = str(error)
    assert f"- at `$.{field}" in message, message


def _validate(document: Any, schema: dict[str, Any]) -> None:
    """jsonschema's verdict, where it takes the schema (we accept some it does not, such
    as a `required` list that names a property twice)."""
    with contextlib.suppress(jsonschema.SchemaError):
        jsonschema.validate(document, schema)


def _no_ref(schema: Any) -> bool:
    return "$ref" not in json.dumps(schema)


@PROPERTY_SETTINGS
@given(SCHEMA_DOCUMENTS)
def test_any_schema_is_refused_naming_the_place_or_converts_parses_and_closes(
        probe: GrammarProbe, schema: Any) -> None:
    try:
        checked = check_schema(schema)
    except GrammarError as error:
        _names_a_place(error, "json_schema")
        return
    try:
        text = checked_to_gbnf(checked)
    except GrammarError as error:  # a bound of gbnfcheck.py
        _names_a_place(error, "json_schema")
        return
    assert probe.parses(text), text
    shape = shape_of(checked.root, checked.refs)
    shortest = shape.shortest
    if len(shortest) < 100000:  # a document the closer can write: it is whole and valid
        document = json.loads(shortest)
        tracker = JsonTracker(shape)
        tracker.feed(shortest)
        assert not tracker.lost and tracker.completions()[:1] == [b""], shortest
        if _no_ref(schema):  # jsonschema reads references otherwise (~ and % escapes)
            _validate(document, schema)


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
@given(GBNF_TEXTS)
def test_any_text_as_gbnf_is_refused_naming_the_field_or_parses_in_bounded_time(
        probe: GrammarProbe, text: str) -> None:
    try:
        check_gbnf(text)
    except GrammarError as error:
        message = str(error)
        _names_a_place(error, "grammar")
        ours_only = "left recursion" in message or "does not parse" not in message
        if not ours_only and "\x00" not in text:  # a syntax error llama.cpp sees too
            assert not probe.parses(text), message
        return
    probe.parses(text)  # it finishes (within the probe's time and memory), either way


@PROPERTY_SETTINGS
@given(PATTERNS | st.text(max_size=12))
def test_any_pattern_is_refused_naming_it_or_becomes_a_grammar_that_parses(
        probe: GrammarProbe, pattern: str) -> None:
    schema = {"type": "string", "pattern": pattern}
    try:
        text = schema_to_gbnf(schema)
    except GrammarError as error:
        assert "- at `$.json_schema.pattern`" in str(error), error
        if len(pattern) >= 2 and pattern[0] == "^" and pattern[-1] == "$":
            with pytest.raises(GrammarError):
                check_pattern(pattern[1:-1], "$")
        return
    assert probe.parses(text), text
    assert pattern_gbnf(pattern[1:-1]) in text


# --- examples ----------------------------------------------------------------------------

WRONG_VALUES: list[Any] = [None, True, 0, -1, 2.5, 10**30, "", "x", "date", [], ["date"],
                           [None], {}, {"x": 1}, {"type": "string"}]


def _place_of(message: str) -> str:
    return message.rsplit("- at `", 1)[1].rstrip("`")


def _resolves(document: Any, place: str) -> bool:
    """Whether `place` (as the errors name places) is a location in the document."""
    node = {"json_schema": document}
    for part in place.removeprefix("$.").replace("[", ".[").split("."):
        if part.startswith("[") and isinstance(node, list):
            index = int(part[1:-1])
            if index >= len(node):
                return False
            node = node[index]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return False
    return True


# --- one walk: the grammar is written from the shape ----------------------------------


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


def test_every_value_of_every_keyword_replaced_by_any_json_is_named_or_converts(
        probe: GrammarProbe) -> None:
    """Each keyword's value (and each schema) of schemas using every keyword, replaced in
    turn by values of every JSON type: an invalid_request naming a place that exists in
    the schema, or a grammar llama.cpp parses."""
    converted = refused = 0
    for base in BASES:
        for index in range(len(_places(base))):
            for wrong in WRONG_VALUES:
                schema = copy.deepcopy(base)
                owner, key = _places(schema)[index]
                owner[key] = wrong
                try:
                    text = schema_to_gbnf(schema)
                except GrammarError as error:
                    refused += 1
                    place = _place_of(str(error))
                    assert _resolves(schema, place), (str(error), schema)
                    continue
                converted += 1
                assert probe.parses(text), (schema, text)
    assert converted > 100 and refused > 500, (converted, refused)




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


@pytest.mark.parametrize("schema", [
    {"description": "any object"},  # annotations only: was refused, is {}
    {"additionalProperties": True},
    {"required": []},
    {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"]},
    {"const": {"$ref": 5}},
    {"type": "object", "properties": {"*": {"type": "integer"}, "b": {"type": "null"}}},
    {"type": "string", "pattern": "^a|b$"},
    _ref_chain(30),
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
])
def test_schemas_the_stock_converter_tripped_on_convert_and_close(
        probe: GrammarProbe, schema: dict[str, Any]) -> None:
    checked = check_schema(schema)
    text = checked_to_gbnf(checked)
    assert probe.parses(text), text
    shortest = shape_of(checked.root, checked.refs).shortest
    jsonschema.validate(json.loads(shortest), schema)


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


def test_a_grammar_just_within_the_branch_bound_parses_quickly(probe: GrammarProbe) -> None:
    check_gbnf(_exponential(12))  # 4096 first stacks: the most the bound lets through
    started = time.monotonic()
    assert probe.parses(_exponential(12))
    # Unhurried, this takes about 20 ms; 2**18 stacks took over two minutes.
    assert time.monotonic() - started < 10


# --- through the daemon ----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_bad_values_in_schemas_and_grammars_are_invalid_requests_and_serving_goes_on(
        ) -> None:
    cases = [
        ({"json_schema": {"type": "string", "format": ["date"]}},
         "at `$.json_schema.format`"),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                  "format": {"x": 1}}}}},
         "at `$.json_schema.properties.a.format`"),
        # The stock pattern converter looped forever on a stray ].
        ({"json_schema": {"type": "string", "pattern": "^]$"}},
         "at `$.json_schema.pattern`"),
        ({"json_schema": {"$ref": "#/default", "default": {"type": 5}}},
         "at `$.json_schema.default.type`"),
        ({"json_schema": {"type": "array", "items": {"enum": [_nested(200)]}}},
         "at `$.json_schema.items.enum`"),
        # 2**18 first stacks: llama.cpp took minutes to build them, on the event loop.
        ({"grammar": _exponential(18)}, "is too wide"),
        ({"grammar": "root ::= [a-z]{0,3000}"}, "at most 2000"),
    ]
    async with running_daemon() as daemon, daemon.client() as client:
        for index, (fields, fragment) in enumerate(cases):
            reply = await client.final({"id": index, "prompt": "x", "max_tokens": 4, **fields})
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            assert reply["id"] == index and fragment in reply["message"], reply
            done = done_of(await client.request(
                {"prompt": "x", "grammar": 'root ::= "ok"', "max_tokens": 4,
                 "stream": False}))
            assert done["text"] == "ok" and done["finish_reason"] == "stop", done
        done = done_of(await client.request(
            {"prompt": "x", "json_schema": {"description": "any object", "title": 5},
             "max_tokens": 8, "stream": False}))
        assert done["type"] == "done", done
        stats = await client.final({"op": "stats"})
        assert stats["errors"]["invalid_request"] == len(cases)
        assert stats["errors"]["internal"] == 0
        assert "Traceback" not in daemon.log


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_a_grammar_costly_to_follow_ends_at_its_budget_and_others_are_served() -> None:
    """Each `a` doubles nothing, but adds a reading (how many `x` will close it): the
    stacks grow with the text, and checking one token against them with its square. Such
    work in the decode steps counts against server.grammar_budget_s like a wide pass."""
    costly = {"id": "costly", "prompt": "a" * 40, "grammar":
              'root ::= r\nr ::= "a" r | "a" r "x" | "b"', "max_tokens": 300,
              "temperature": 0, "stream": False}
    plain = {"id": "plain", "prompt": "The sea is", "max_tokens": 8, "temperature": 0,
             "stream": False}
    async with running_daemon({"server": {"grammar_budget_s": 1.0}}) as daemon, \
            daemon.client() as first, daemon.client() as second:
        await first.send(costly)
        await second.send(plain)
        done = done_of(await second.reply())
        assert done["finish_reason"] == "length", done
        reply = await first.reply()
        assert reply[-1]["type"] == "error" and reply[-1]["code"] == "grammar_dead_end", reply
        assert "grammar_budget_s" in reply[-1]["message"], reply
        assert done_of(await first.request(
            {"prompt": "x", "grammar": 'root ::= "ok"', "max_tokens": 4,
             "stream": False}))["text"] == "ok"
