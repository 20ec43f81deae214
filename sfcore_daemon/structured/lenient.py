"""A tool's parameter schema with the assertions the grammar cannot honour taken out.

Agents send their tools' schemas as their own validators want them: Claude Code's
web fetch has `"format": "uri"`, shells have number bounds, MCP servers bring
`propertyNames`, `uniqueItems` or `oneOf`. Refusing those would refuse every request of
such an agent, while a tool call that is valid against the rest of its schema is what
the agent's own validator reports on if it matters. So for tools (never for a
`json_schema` document, whose validity is the promise) these are relaxed before the
schema is checked: an assertion-only keyword the grammar does not act on is dropped, a
string format it does not know is dropped, bounds on a non-integer number are dropped,
and `oneOf` is read as `anyOf` (a value of one branch is valid against it unless two
branches overlap). Structure it cannot express (`allOf`, `not`, `if`) is still refused
by the checker, naming the place.
"""

from __future__ import annotations

from typing import Any, Final

from sfcore_daemon.structured.checker import INTEGER_KEYWORDS, STRING_FORMATS

# Keywords that only narrow what a value may be, which the grammar does not enforce.
_DROPPED: Final = frozenset({
    "propertyNames", "patternProperties", "minProperties", "maxProperties",
    "dependentRequired", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems",
    "uniqueItems", "contains", "minContains", "maxContains", "multipleOf",
    "contentEncoding", "contentMediaType", "contentSchema",
})
# Schemas below these keywords (each a schema, a list of them, or a map of them).
_ONE: Final = ("items", "additionalProperties", "not", "if", "then", "else")
_MANY: Final = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP: Final = ("properties", "$defs", "definitions")
# Deeper than the checker allows anything: it refuses the rest, naming the place.
_MAX_DEPTH: Final = 64


def relax_tool_schema(schema: Any) -> tuple[Any, list[str]]:
    """The schema to check and make the grammar from, and the keywords taken out (each
    as `path.keyword`, for the log)."""
    dropped: list[str] = []
    return _relax(schema, "$", dropped, 0), dropped


def _relax(schema: Any, path: str, dropped: list[str], depth: int) -> Any:
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return schema
    relaxed: dict[str, Any] = {}
    number = schema.get("type") == "number"
    for key, value in schema.items():
        if key in _DROPPED or (number and key in INTEGER_KEYWORDS) or (
                key == "format" and not (isinstance(value, str) and value in STRING_FORMATS)):
            dropped.append(f"{path}.{key}")
            continue
        name = "anyOf" if key == "oneOf" and "anyOf" not in schema else key
        relaxed[name] = _below(name, value, path, dropped, depth)
    return relaxed


def _below(key: str, value: Any, path: str, dropped: list[str], depth: int) -> Any:
    """`value` of `key` with the schemas in it relaxed."""
    if key in _ONE:
        return _relax(value, f"{path}.{key}", dropped, depth + 1)
    if key in _MANY and isinstance(value, list):
        return [_relax(item, f"{path}.{key}[{index}]", dropped, depth + 1)
                for index, item in enumerate(value)]
    if key in _MAP and isinstance(value, dict):
        return {name: _relax(item, f"{path}.{key}.{name}", dropped, depth + 1)
                for name, item in value.items()}
    return value
