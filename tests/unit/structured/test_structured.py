"""Structured output (json_schema, format "json", grammar) through the real daemon and model,
and the schema checks on their own.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_structured.py.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from sfcore_daemon.structured.compiler import check_schema, schema_to_gbnf
from sfcore_daemon.structured.grammar import GrammarError, check_gbnf
from tests.kit import REPO
from tests.kit.structured import (
    SCHEMAS,
)


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "number", "minimum": 0}, "minimum is supported only with \"type\": \"integer\""),
    ({"minimum": 0}, "minimum is supported only with"),
    ({"type": "integer", "minimum": 5, "exclusiveMaximum": 5}, "no integer is within the bounds"),
    ({"type": "integer", "maximum": 1e20}, "maximum must be a number from"),
    ({"type": "integer", "multipleOf": 2}, "unsupported JSON Schema keyword 'multipleOf'"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}},
     "unsupported string format 'email'"),
    ({"properties": {"a": {"oneOf": [{"type": "string"}]}}},
     "'oneOf' - at `$.json_schema.properties.a`"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
     "required property 'b' is not in properties"),
    ({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 2},
     "minItems is above maxItems"),
    ({"type": "array", "maxItems": 2}, "minItems and maxItems need items"),
    ({"type": "array", "items": {}, "maxItems": 100000},
     "maxItems must be an integer from 0 to 2000"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"$ref": "https://example.org/schema.json"}, "only local references"),
    ({"type": "string", "enum": ["a", 1]}, "value 1 is not of type 'string'"),
    ({"enum": []}, "enum must be a non-empty list"),
    ({"type": "object", "properties": {"a": True}}, "boolean schemas are not supported"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     "additionalProperties other than false"),
    ({"type": ["string", "null"], "maxLength": 3}, "type cannot be combined with maxLength"),
    ({"type": "string", "pattern": "[a-z]+"}, "pattern must be anchored"),
    ({"type": "string", "pattern": "^\\d+$"}, "pattern escape '\\\\d' is not supported"),
    ({"type": "string", "pattern": "^.*$"}, "pattern '.' is not supported"),
    ({"type": "string", "pattern": "^[^,]+$"}, "no negated classes"),
    ({"type": "string", "pattern": "^[ -~]+$"}, "characters a JSON string must escape"),
    ({"type": "strnig"}, "type must be one of"),
])
def test_unsupported_schemas_are_refused_naming_the_problem(schema: dict[str, Any],
                                                            fragment: str) -> None:
    with pytest.raises(GrammarError) as caught:
        check_schema(schema)
    assert fragment in str(caught.value)


def test_supported_schemas_convert_and_unsupported_grammar_nesting_is_refused() -> None:
    for schema in SCHEMAS.values():
        check_schema(schema)
        assert "root ::=" in schema_to_gbnf(schema)
    with pytest.raises(GrammarError, match="deeper than 64"):
        check_gbnf("root ::= " + "(" * 100 + '"a"' + ")" * 100)
    check_gbnf('root ::= "((((((((" [(((] # ((((\n')


def test_compiling_a_schema_imports_neither_numpy_nor_the_high_level_package() -> None:
    """The compiler writes GBNF itself: not even llama-cpp-python's converter module."""
    code = ("import sys; import sfcore_daemon.core.server; "
            "from sfcore_daemon.structured import compiler; "
            "compiler.schema_to_gbnf({'type': 'object', 'properties': {'a': {}}}); "
            "compiler.compile_json_object(); "
            "bad = [m for m in ('numpy', 'llama_cpp.llama', 'llama_cpp.llama_grammar') "
            "if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
