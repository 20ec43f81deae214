"""The JSON document the client tests ask every client for: one schema, one prompt, and
the Python client's answer to compare other clients' bytes with."""

from __future__ import annotations

from typing import Any

import sfcore_client

# The schema and prompt tests/clients/test_sfcore_cli.py uses: greedy, the model fills in a
# whole record well within max_tokens (maxLength bounds the name).
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                   "alive": {"type": "boolean"}},
    "required": ["name", "age", "alive"]}
PERSON_PROMPT = ('JSON records, one per line.\n'
                 'Example: {"name": "Ada Lovelace", "age": 36, "alive": false}\n'
                 'Example: {"name": "Linus", "age": 54, "alive": true}\nExample: ')

# Every request gives the bytes of a cold run, whatever ran before it: a client's
# document can be compared with the Python client's.
REPRODUCIBLE: dict[str, Any] = {"model": {"reproducible": True}}


def assert_person(document: Any) -> None:
    """Exactly the schema's required keys, in its order, each of its type (bool is not an
    integer)."""
    assert isinstance(document, dict), document
    assert list(document) == PERSON_SCHEMA["required"], document
    assert isinstance(document["name"], str) and len(document["name"]) <= 24, document
    assert type(document["age"]) is int and type(document["alive"]) is bool, document


def python_client_document(path: str, prompt: str) -> str:
    with sfcore_client.Client(path, timeout=60) as client:
        result = client.generate(prompt, json_schema=PERSON_SCHEMA, max_tokens=200,
                                 temperature=0, cache_prompt=False)
    assert result.finish_reason == "stop", result
    text: str = result.text
    return text
