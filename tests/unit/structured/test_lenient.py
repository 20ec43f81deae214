"""Tool schemas relaxed of what the grammar cannot enforce (structured/lenient.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.structured.checker import check_schema
from sfcore_daemon.structured.gbnfcheck import GrammarError
from sfcore_daemon.structured.lenient import relax_tool_schema


def test_what_agents_send_is_relaxed_and_then_checks() -> None:
    schema = {
        "type": "object", "required": ["url"],
        "properties": {
            "url": {"type": "string", "format": "uri", "description": "the page"},
            "when": {"type": "string", "format": "date-time"},
            "timeout": {"type": "number", "minimum": 0, "maximum": 600},
            "retries": {"type": "integer", "minimum": 0, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            "mode": {"oneOf": [{"const": "fast"}, {"const": "full"}]},
        },
        "propertyNames": {"pattern": "^[a-z]+$"},
    }
    relaxed, dropped = relax_tool_schema(schema)
    assert sorted(dropped) == sorted([
        "$.properties.url.format", "$.properties.timeout.minimum",
        "$.properties.timeout.maximum", "$.properties.tags.uniqueItems", "$.propertyNames"])
    properties = relaxed["properties"]
    assert properties["when"]["format"] == "date-time"  # the grammar enforces it
    assert properties["retries"]["maximum"] == 5  # and integer bounds
    assert properties["mode"] == {"anyOf": [{"const": "fast"}, {"const": "full"}]}
    assert schema["properties"]["url"]["format"] == "uri"  # the client's own is untouched
    check_schema(relaxed)


def test_structure_the_grammar_cannot_express_is_still_refused() -> None:
    for schema in ({"allOf": [{"type": "object"}]}, {"type": "object", "not": {}},
                   {"type": "object", "properties": {"a": {"type": "text"}}}):
        relaxed, _ = relax_tool_schema(schema)
        try:
            check_schema(relaxed)
        except GrammarError:
            continue
        raise AssertionError(f"accepted: {schema}")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.sampled_from(["object", "string", "number", "integer", "uri", "date", "array"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "format", "properties", "items", "oneOf", "anyOf", "minimum",
                         "maximum", "propertyNames", "required", "enum", "const", "$ref",
                         "additionalProperties", "uniqueItems", "x"]) | st.text(max_size=5),
        children, max_size=4),
    max_leaves=12)


@given(_json)
def test_any_value_relaxes_to_a_schema_or_a_named_refusal(schema: Any) -> None:
    relaxed, dropped = relax_tool_schema(schema)
    assert all(place.startswith("$") for place in dropped)
    try:
        check_schema(relaxed)
    except GrammarError as exc:
        assert "at `" in str(exc) or "schema" in str(exc)
