"""Any JSON value where a schema keyword expects a string, a number, a list or an object,
and any text as GBNF: the checks answer with a GrammarError naming the field (an
`invalid_request`), or what they let through converts, parses in llama.cpp and closes;
never another exception. Properties first (hypothesis, bounded), then examples, then the
same through the real daemon.

This file holds the tests of llama.cpp and the real model in-process; those that need no
daemon and no model in tests/unit/structured/test_schema_property.py; those against the
real daemon in tests/e2e/ndjson/test_schema_property.py.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.structured.checker import check_schema
from sfcore_daemon.structured.compiler import checked_to_gbnf, schema_to_gbnf
from sfcore_daemon.structured.gbnfcheck import GrammarError, check_gbnf
from sfcore_daemon.structured.pattern import check_pattern, pattern_gbnf
from sfcore_daemon.structured.shape import shape_of
from sfcore_daemon.structured.tracker import JsonTracker
from tests.kit.grammar_probe import GrammarProbe
from tests.kit.schemas import (
    BASES,
    PATTERNS,
    PROPERTY_SETTINGS,
    SCHEMA_DOCUMENTS,
    exponential,
    names_a_place,
    places_in,
    ref_chain,
)


@pytest.fixture(scope="module")
def probe() -> Iterator[GrammarProbe]:
    grammar_probe = GrammarProbe()
    yield grammar_probe
    grammar_probe.close()


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
        names_a_place(error, "json_schema")
        return
    try:
        text = checked_to_gbnf(checked)
    except GrammarError as error:  # a bound of gbnfcheck.py
        names_a_place(error, "json_schema")
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
@given(GBNF_TEXTS)
def test_any_text_as_gbnf_is_refused_naming_the_field_or_parses_in_bounded_time(
        probe: GrammarProbe, text: str) -> None:
    try:
        check_gbnf(text)
    except GrammarError as error:
        message = str(error)
        names_a_place(error, "grammar")
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


def test_every_value_of_every_keyword_replaced_by_any_json_is_named_or_converts(
        probe: GrammarProbe) -> None:
    """Each keyword's value (and each schema) of schemas using every keyword, replaced in
    turn by values of every JSON type: an invalid_request naming a place that exists in
    the schema, or a grammar llama.cpp parses."""
    converted = refused = 0
    for base in BASES:
        for index in range(len(places_in(base))):
            for wrong in WRONG_VALUES:
                schema = copy.deepcopy(base)
                owner, key = places_in(schema)[index]
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


@pytest.mark.parametrize("schema", [
    {"description": "any object"},  # annotations only: was refused, is {}
    {"additionalProperties": True},
    {"required": []},
    {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"]},
    {"const": {"$ref": 5}},
    {"type": "object", "properties": {"*": {"type": "integer"}, "b": {"type": "null"}}},
    {"type": "string", "pattern": "^a|b$"},
    {"enum": [{"\x85": None}, "\x01\u2028\t"]},  # written as \x, \u and \t escapes
    ref_chain(30),
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}},
])
def test_schemas_the_stock_converter_tripped_on_convert_and_close(
        probe: GrammarProbe, schema: dict[str, Any]) -> None:
    checked = check_schema(schema)
    text = checked_to_gbnf(checked)
    assert probe.parses(text), text
    shortest = shape_of(checked.root, checked.refs).shortest
    jsonschema.validate(json.loads(shortest), schema)


def test_a_grammar_just_within_the_branch_bound_parses_quickly(probe: GrammarProbe) -> None:
    check_gbnf(exponential(12))  # 4096 first stacks: the most the bound lets through
    started = time.monotonic()
    assert probe.parses(exponential(12))
    # Unhurried, this takes about 20 ms; 2**18 stacks took over two minutes.
    assert time.monotonic() - started < 10
