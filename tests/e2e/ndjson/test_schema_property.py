"""Any JSON value where a schema keyword expects a string, a number, a list or an object,
and any text as GBNF: the checks answer with a GrammarError naming the field (an
`invalid_request`), or what they let through converts, parses in llama.cpp and closes;
never another exception. Properties first (hypothesis, bounded), then examples, then the
same through the real daemon.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/structured/test_schema_property.py; those of llama.cpp and the real
model in-process in tests/e2e/llama/test_schema_property.py.
"""

from __future__ import annotations

import pytest

from tests.kit import done_of, running_daemon
from tests.kit.schemas import exponential, nested


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
        ({"json_schema": {"type": "array", "items": {"enum": [nested(200)]}}},
         "at `$.json_schema.items.enum`"),
        # 2**18 first stacks: llama.cpp took minutes to build them, on the event loop.
        ({"grammar": exponential(18)}, "is too wide"),
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
