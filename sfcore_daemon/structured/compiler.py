"""JSON Schema to GBNF, on the event loop before a request is queued.

`compile_schema` turns a client's JSON Schema into the GBNF text llama.cpp's grammar
sampler runs and the shape of the documents it allows (budget-aware closing). The flow,
one walk of the schema:

1. checker.py (`check_schema`) reads the schema as the client sent it and refuses what
   cannot be honoured, with a `GrammarError` naming the field (`invalid_request`); what
   it returns holds only what the next step acts on.
2. shape.py (`shape_of`) walks the checked schema once into a tree of `Shape`s, the one
   intermediate form.
3. gbnf.py (`shape_gbnf`) writes the GBNF from the shapes alone, and the text is held to
   the same structural bounds as a client's grammar (gbnfcheck.py).

The grammar and the closing shape are both the tree, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sfcore_daemon.structured.checker import CheckedSchema, check_schema
from sfcore_daemon.structured.gbnf import (
    CONVERTER_REPEAT,
    SCHEMA_GRAMMAR_NESTING,
    integer_range_gbnf,
    json_gbnf,
    shape_gbnf,
)
from sfcore_daemon.structured.gbnfcheck import check_gbnf
from sfcore_daemon.structured.shape import Shape, free_object, shape_of

__all__ = ["CONVERTER_REPEAT", "SCHEMA_GRAMMAR_NESTING", "CompiledSchema", "check_schema",
           "checked_to_gbnf", "compile_json_object", "compile_schema", "integer_range_gbnf",
           "json_gbnf", "schema_to_gbnf"]


class CompiledSchema(NamedTuple):
    """A schema compiled: the GBNF text llama.cpp's grammar sampler runs, and the shape
    of the documents it allows, which budget-aware closing (closer.py) completes."""

    gbnf: str
    shape: Shape


def compile_schema(schema: Any) -> CompiledSchema:
    """A client's JSON Schema compiled; GrammarError naming the place of the first thing
    the conversion cannot honour, or if its grammar is past the bounds of gbnfcheck.py."""
    checked = check_schema(schema)
    shape = shape_of(checked.root, checked.refs)
    return CompiledSchema(_checked_gbnf(shape), shape)


def compile_json_object() -> CompiledSchema:
    """Any JSON object (`format: "json"`)."""
    return CompiledSchema(json_gbnf(), free_object())


def schema_to_gbnf(schema: Any) -> str:
    """GBNF for documents valid against `schema`; GrammarError if it uses a keyword the
    conversion cannot honour, or its grammar is past the bounds of gbnfcheck.py."""
    return compile_schema(schema).gbnf


def checked_to_gbnf(checked: CheckedSchema) -> str:
    """The GBNF of a checked schema (by way of its shape)."""
    return _checked_gbnf(shape_of(checked.root, checked.refs))


def _checked_gbnf(shape: Shape) -> str:
    """The GBNF of a schema's shape. A checked schema holds nothing the emitter could
    trip on: an exception other than the bound check's GrammarError is a daemon bug."""
    text = shape_gbnf(shape)
    check_gbnf(text, "json_schema", max_nesting=SCHEMA_GRAMMAR_NESTING)
    return text
