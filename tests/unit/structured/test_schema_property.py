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

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core.admission import request_grammar
from sfcore_daemon.core.request import GenerateRequest
from sfcore_daemon.structured.compiler import compile_schema, schema_to_gbnf
from sfcore_daemon.structured.gbnf import shape_gbnf
from sfcore_daemon.structured.gbnfcheck import MAX_GRAMMAR_BRANCHES, GrammarError, check_gbnf
from sfcore_daemon.structured.tracker import JsonTracker
from tests.kit.gbnf import accepts
from tests.kit.schemas import (
    JSON_VALUES,
    KEYWORDS,
    PROPERTY_SETTINGS,
    SCHEMA_DOCUMENTS,
    exponential,
    names_a_place,
    nested,
    ref_chain,
)


@PROPERTY_SETTINGS
@given(st.dictionaries(st.sampled_from(KEYWORDS), JSON_VALUES, max_size=4) | SCHEMA_DOCUMENTS)
def test_the_request_path_answers_a_grammar_or_an_invalid_request(schema: Any) -> None:
    if not isinstance(schema, dict):
        return  # the request decoder refuses a json_schema that is not an object
    try:
        spec = request_grammar(GenerateRequest(prompt="x", json_schema=schema))
    except GrammarError as error:
        names_a_place(error, "json_schema")
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
    # A line break Python splits on (NEL) and a control character, written as escapes.
    ({"enum": [{"\x85": None}, "\x01\u2028"]}, '"\\u0001\u2028"'),
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
    ({"enum": [nested(100)]}, "value nested deeper than 64", "$.json_schema.enum"),
    ({"const": nested(900)}, "value nested deeper than 64", "$.json_schema.const"),
    (ref_chain(200), "deeper than 128 levels counting through $ref", "$.json_schema"),
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
    (exponential(13), f"more than {MAX_GRAMMAR_BRANCHES}"),
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
