"""Schemas the structured-output tests and benches share: JSON records of every kind a
schema holds (objects, enums, escapes, unbounded arrays, integer bounds), few-shot
prompts that show their format, and the tight-budget cases (a schema and its prompt)."""

from __future__ import annotations

from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "email": {"type": "string", "maxLength": 32},
        "alive": {"type": "boolean"},
    },
    "required": ["name", "age", "alive"],
}


ORDER = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["id", "tier"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "status": {"enum": ["new", "paid", "shipped"]},
    },
    "required": ["customer", "items", "status"],
}


TAGS = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 2, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "kind": {"const": "tagged"},
    },
    "required": ["tags", "kind"],
    "$defs": {"unused": {"type": "null"}},
}


# Values a model must write with escapes (quote, backslash, newline, tab) and beyond ASCII.
TEXT = {
    "type": "object",
    "properties": {
        "quote": {"enum": ['say "hi"', "back\\slash", "line\nbreak", "tab\there",
                           "naïve café", "日本語", "emoji 🎉"]},
        "note": {"type": "string", "maxLength": 40},
        "lang": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/lang"}]},
    },
    "required": ["quote", "note"],
    "$defs": {"lang": {"enum": ["fr", "ja", "de"]}},
}


# An unbounded array of objects (replies used to repeat an item until max_tokens ran out).
LEGS = {
    "type": "object",
    "properties": {
        "legs": {"type": "array", "items": {
            "type": "object",
            "properties": {"km": {"type": "integer"}, "ok": {"type": "boolean"},
                           "note": {"type": "string"}},
            "required": ["km", "ok"]}},
    },
    "required": ["legs"],
}


# Integer bounds at their edges, inclusive and exclusive, both signs.
BOUNDED = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "minimum": 3, "maximum": 7},
        "delta": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "debt": {"type": "integer", "maximum": -10},
    },
    "required": ["level", "delta", "year", "debt"],
}


SCHEMAS = {"person": PERSON, "order": ORDER, "tags": TAGS, "text": TEXT}


EXAMPLES = {
    "person": ['{"name": "Ada Lovelace", "age": 36, "height_m": 1.65, "alive": false}',
               '{"name": "Linus", "age": 54, "alive": true, "email": "linus@example.org"}'],
    "order": ['{"customer": {"id": 17, "tier": "pro"}, "items": [{"sku": "ABC-12", "qty": 2,'
              ' "price": 9.5}], "status": "paid"}'],
    "tags": ['{"tags": ["red", "blue", "green"], "scores": [0.5, 2], "kind": "tagged"}'],
    "text": ['{"quote": "naïve café", "note": "He said \\"bonjour\\" \\\\ à Paris", '
             '"lang": "fr"}',
             '{"quote": "line\\nbreak", "note": "東京 is big\\tand busy", "lang": null}'],
}


def few_shot(name: str) -> str:
    lines = "\n".join(f"Example: {example}" for example in EXAMPLES[name])
    return f"JSON records, one per line.\n{lines}\nExample: "


# What each tight-budget case asks for, and a prompt that shows the format.
ENUMS = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "somewhat anxious", "exuberant beyond words"]},
        "colour": {"enum": ["red", "green", "blue", "ultraviolet"]},
        "level": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["mood", "colour", "level"],
}


STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 10},
        "story": {"type": "string"},
        "words": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "story", "words"],
}


BUDGET_CASES: dict[str, tuple[dict[str, Any] | None, str]] = {
    "order": (ORDER, few_shot("order")),
    "legs": (LEGS, 'Trip legs as JSON.\nExample: {"legs": [{"km": 12, "ok": true}, '
                   '{"km": 7, "ok": false, "note": "rain"}]}\nExample: '),
    "enums": (ENUMS, 'Moods as JSON.\nExample: {"mood": "calm", "colour": "blue", '
                     '"level": 2}\nExample: '),
    "story": (STORY, "A long story as JSON with a title, the story and its rare words.\n"
                     '{"title": "'),
    "json": (None, few_shot("person")),
}

