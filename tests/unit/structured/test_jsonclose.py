"""The JSON tracker and shortest completions (shape.py, tracker.py) and the integer
range grammar, on their own: no model, no daemon."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from sfcore_daemon.structured.compiler import check_schema, integer_range_gbnf, schema_to_gbnf
from sfcore_daemon.structured.shape import free_object, shape_of, shortest_integer
from sfcore_daemon.structured.tracker import JsonTracker
from tests.kit.structured import BOUNDED, EXAMPLES, LEGS, SCHEMAS

DOCUMENTS: list[tuple[dict[str, Any] | None, str]] = [
    # Required properties first, then optional ones: the order the grammar writes.
    (SCHEMAS["person"], '{"name": "Ada", "age": 36, "alive": false, "height_m": 1.65}'),
    (SCHEMAS["person"], '{"name": "Linus", "age": -54, "alive": true, "email": "l@x.org"}'),
    (SCHEMAS["order"], EXAMPLES["order"][0]),
    (SCHEMAS["tags"], '{"tags": ["red", "blue"], "kind": "tagged", "scores": [0.5, 2]}'),
    *[(SCHEMAS["text"], text) for text in EXAMPLES["text"]],
    (LEGS, '{"legs": [{"km": 12, "ok": true}, {"km": 0, "ok": false, "note": "muddy \\u00e9"}]}'),
    (BOUNDED, '{"level": 5, "delta": -4, "year": 2024, "debt": -12}'),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                       "id": {"type": "string", "format": "uuid"}},
      "required": ["when", "id"]},
     '{"when": "2024-02-29T13:05:09.123+01:00", "id": "0f8fad5b-d9cb-469f-a165-70867728950e"}'),
    ({"type": "array", "prefixItems": [{"type": "number"}, {"type": ["string", "null"]}]},
     '[-1.5e+3, null]'),
    (None, '{"a": [1, 2.5, {"b": "x\\ny", "c": null}], "d": true, "e": {}}'),
]


def _close(schema: dict[str, Any] | None, text: bytes) -> bytes | None:
    tracker = JsonTracker(shape_of(schema) if schema is not None else free_object())
    tracker.feed(text)
    completions = tracker.completions()
    return completions[0] if completions else None


@pytest.mark.parametrize(("schema", "document"), DOCUMENTS)
def test_every_prefix_closes_into_a_valid_document(schema: dict[str, Any] | None,
                                                   document: str) -> None:
    data = document.encode()
    if schema is not None:
        check_schema(schema)
        jsonschema.validate(json.loads(data), schema)
    for end in range(len(data) + 1):
        completion = _close(schema, data[:end])
        assert completion is not None, data[:end]
        closed = json.loads(data[:end] + completion)
        if schema is not None:
            jsonschema.validate(closed, schema)
    assert _close(schema, data) == b""


def test_completions_are_shortest_and_follow_the_grammars_order() -> None:
    order = SCHEMAS["order"]
    assert shape_of(order).shortest == (b'{"customer":{"id":0,"tier":"pro"},"items":[{"sku":'
                                        b'"AAA-00","qty":0}],"status":"new"}')
    assert _close(order, b'{"customer": {"id": 17, "ti') == (
        b'er":"pro"},"items":[{"sku":"AAA-00","qty":0}],"status":"new"}')
    # An unbounded array closes rather than start another item; a string just ends.
    assert _close(LEGS, b'{"legs": [{"km": 1, "ok": true}, ') == b'{"km":0,"ok":true}]}'
    assert _close(LEGS, b'{"legs": [{"km": 1, "ok": true}') == b"]}"
    assert _close(SCHEMAS["person"], b'{"name": "Ada') == b'","age":0,"alive":true}'
    # minLength still counts, a split escape or character is finished first.
    short_text = {"type": "string", "minLength": 3}
    assert _close(short_text, b'"a') == b'aa"'
    assert _close(short_text, b'"\\u0') == b'000aa"'
    assert _close(short_text, '"é'.encode()[:2]) == b'\x80aa"'
    assert _close(BOUNDED, b'{"level": ') == b'3,"delta":0,"year":1900,"debt":-10}'
    assert _close(None, b'{"a": [1, {"b": tr') == b'ue}]}'


def test_a_random_walk_of_format_json_always_closes() -> None:
    rng = random.Random(7)
    for _ in range(50):
        value = _random_value(rng, 4)
        data = json.dumps({"k": value}, indent=rng.choice([None, 1])).encode()
        for end in range(len(data) + 1):
            completion = _close(None, data[:end])
            assert completion is not None, data[:end]
            json.loads(data[:end] + completion)


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(6 if depth else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -12, 3.25, 1e-7, 12345678])
    if kind in (2, 3):
        return "".join(rng.choice('ab "\\\n\té日') for _ in range(rng.randrange(6)))
    if kind == 4:
        return [_random_value(rng, depth - 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": _random_value(rng, depth - 1) for i in range(rng.randrange(3))}


def test_shortest_integer_respects_bounds() -> None:
    assert shortest_integer(b"", 3, 7) == b"3"
    assert shortest_integer(b"", None, -10) == b"-10"
    assert shortest_integer(b"", -5, 5) == b"0"
    assert shortest_integer(b"1", 100, 200) == b"00"
    assert shortest_integer(b"-", -30, -20) == b"20"
    assert shortest_integer(b"2", 1900, 2100) == b"000"
    assert shortest_integer(b"", None, None) == b"0"
    assert shortest_integer(b"-0", None, None) == b""


def _as_regex(gbnf: str) -> re.Pattern[str]:
    return re.compile(re.sub(r'"([^"]*)"', lambda m: re.escape(m.group(1)), gbnf)
                      .replace(" ", ""))


@pytest.mark.parametrize(("low", "high"), [
    (0, 0), (5, 5), (-5, 5), (1, 100), (-100, -1), (17, 4321), (10, 99), (-1, 0),
    (-9999, 100000), (99, 101), (None, 5), (-3, None), (None, -7), (250, None),
])
def test_integer_range_grammar_matches_exactly_the_integers_in_bounds(
        low: int | None, high: int | None) -> None:
    pattern = _as_regex(integer_range_gbnf(low, high))
    for value in range(-20050, 20050):
        inside = (low is None or value >= low) and (high is None or value <= high)
        assert bool(pattern.fullmatch(str(value))) == inside, (low, high, value)
    for spelling in ("-0", "01", "00", "-01", "1.0"):
        assert not pattern.fullmatch(spelling)


def test_integer_bounds_convert_and_unenforced_bounds_are_refused() -> None:
    assert '"-"' not in schema_to_gbnf({"type": "integer", "minimum": 0})
    assert "root ::= ((" in schema_to_gbnf({"type": "integer", "exclusiveMinimum": 0.5,
                                            "maximum": 9})


def test_long_repetitions_use_counted_gbnf_and_close() -> None:
    many = {"type": "object", "properties": {
        "nums": {"type": "array", "items": {"type": "integer"}, "minItems": 300,
                 "maxItems": 1000},
        "essay": {"type": "string", "minLength": 260, "maxLength": 2000}},
        "required": ["nums", "essay"]}
    check_schema(many)
    gbnf = schema_to_gbnf(many)
    assert '("," space integer){299,999}' in gbnf and "(char){260,2000}" in gbnf
    closed = json.loads(b'{"nums": [1, 2' + (_close(many, b'{"nums": [1, 2') or b""))
    jsonschema.validate(closed, many)
    assert len(closed["nums"]) == 300 and len(closed["essay"]) == 260
