"""Structured output (json_schema, format "json", grammar) through the real daemon and model,
and the schema checks on their own.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/structured/test_structured.py.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sfcore_daemon.structured.shape import free_object, shape_of
from tests.kit import Client, done_of, running_daemon, tokens_text
from tests.kit.faults import health, poll_until
from tests.kit.structured import (
    BOUNDED,
    BUDGET_CASES,
    LEGS,
    ORDER,
    PERSON,
    SCHEMAS,
    TAGS,
    few_shot,
)

SEEDS = range(20)
# Generous: the machine's two CPUs may be shared with other work.
TIMEOUT_S = 300.0


async def pipelined(client: Client, requests: list[dict[str, Any]],
                    timeout: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """Send every request in one write, then collect each one's final line in order."""
    await client.send(*requests)
    return [(await client.reply(timeout))[-1] for _ in requests]


@pytest.mark.asyncio
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", SCHEMAS)
async def test_sampled_outputs_are_valid_against_their_schemas(name: str) -> None:
    """20 seeds at temperature 1.0, pipelined: each output parses and validates."""
    schema = SCHEMAS[name]
    failures = []
    texts = []
    async with running_daemon() as daemon, daemon.client() as client:
        requests = [{"id": seed, "prompt": few_shot(name), "json_schema": schema,
                     "temperature": 1.0, "seed": seed, "max_tokens": 256, "stream": False}
                    for seed in SEEDS]
        for done in await pipelined(client, requests):
            text = done.get("text", "")
            texts.append(text)
            if done["type"] != "done" or done["finish_reason"] != "stop":
                failures.append((done["id"], done, text))
                continue
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append((done["id"], str(exc)[:200], text))
        stats = await client.final({"op": "stats"})
    assert not failures, failures
    if name == "text":  # the enum's values and the free note need escapes and non-ASCII
        assert any("\\" in text for text in texts), texts
        assert any(any(ord(c) > 127 for c in text) for text in texts), texts
    grammar = stats["grammar"]
    assert grammar["requests"] == len(SEEDS)
    # Every token was checked against its grammar: each generated one, and the
    # end-of-generation token that closed each document.
    assert grammar["tokens"] == stats["tokens"]["generated"] + len(SEEDS), (grammar, stats)


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_enum_values_with_control_characters_and_line_breaks_come_back_whole() -> None:
    """The grammar writes these characters as escapes; llama.cpp must read the escapes as
    the characters, so every sampled document is one of the values, byte for byte."""
    values: list[Any] = [{"\x85": None}, "\x01\u2028\t", "a\u2029\x7f"]
    schema = {"enum": values}
    async with running_daemon() as daemon, daemon.client() as client:
        answers = await pipelined(client, [
            {"prompt": "Pick one:", "json_schema": schema, "temperature": 1.0, "seed": seed,
             "max_tokens": 64, "stream": False} for seed in range(6)])
        assert (await client.final({"op": "health"}))["type"] != "error"
    for done in answers:
        assert done["type"] == "done" and done["finish_reason"] == "stop", done
        assert json.loads(done["text"]) in values, done

@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_gbnf_grammars_and_format_json() -> None:
    yes_no = 'root ::= ("yes" | "no") "."'
    items = 'root ::= item{2,3}\nitem ::= "- " [a-z ]{1,20} "\\n"'
    async with running_daemon() as daemon, daemon.client() as client:
        answers = await pipelined(client, [
            {"prompt": "Is the sky blue? Answer:", "grammar": yes_no, "temperature": 1.0,
             "seed": seed, "max_tokens": 8, "stream": False} for seed in range(5)])
        for done in answers:
            assert done["finish_reason"] == "stop", done
            assert done["text"] in ("yes.", "no."), done
        lists = await pipelined(client, [
            {"prompt": "Shopping list:\n", "grammar": items, "temperature": 1.0,
             "seed": seed, "max_tokens": 96, "stream": False} for seed in range(5)])
        for done in lists:
            assert done["finish_reason"] == "stop", done
            lines = done["text"].split("\n")
            assert lines[-1] == "" and 2 <= len(lines) - 1 <= 3, done
            assert all(line.startswith("- ") for line in lines[:-1]), done
        objects = await pipelined(client, [
            {"prompt": few_shot("person"), "format": "json", "temperature": 0.7,
             "seed": seed, "max_tokens": 200, "stream": False} for seed in range(5)])
        for done in objects:
            assert done["finish_reason"] == "stop", done
            assert isinstance(json.loads(done["text"]), dict), done
        chat = done_of(await client.request(
            {"op": "chat", "messages": [{"role": "user", "content": "Describe a person in "
                                         "JSON with name, age and alive."}],
             "json_schema": PERSON, "temperature": 0, "max_tokens": 200, "stream": False},
            TIMEOUT_S))
        assert chat["finish_reason"] == "stop", chat
        jsonschema.validate(json.loads(chat["text"]), PERSON)


@pytest.mark.asyncio
async def test_bad_schemas_and_grammars_are_invalid_request_and_the_daemon_keeps_serving() \
        -> None:
    cases = [
        ({"json_schema": {"type": "integer", "minimum": 4, "maximum": 3}},
         "no integer is within the bounds (minimum above maximum) - at `$.json_schema`"),
        ({"json_schema": {"type": "number", "maximum": 3}},
         "maximum is supported only with \"type\": \"integer\""),
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "string",
                                                                  "format": "uri"}}}},
         "at `$.json_schema.properties.a.format`"),
        ({"grammar": "root ::= undefined-rule"}, "Undefined rule identifier 'undefined-rule'"),
        ({"grammar": 'root ::= ("a"'}, "the grammar does not parse: expecting ')'"),
        ({"grammar": 'start ::= "a"'}, "the grammar does not parse"),
        ({"grammar": "root ::= root \"a\""}, "the grammar does not parse"),
        ({"grammar": "root ::= " + "(" * 80 + '"a"' + ")" * 80}, "deeper than 64"),
        ({"grammar": 'root ::= "a"', "format": "json"}, "exclude each other"),
        ({"format": "yaml"}, "at `$.format`"),
        ({"json_schema": "{}"}, "Expected `object | null`, got `str` - at `$.json_schema`"),
        ({"grammar": ""}, "at `$.grammar`"),
    ]
    async with running_daemon() as daemon, daemon.client() as client:
        for index, (fields, fragment) in enumerate(cases):
            reply = await client.final({"id": index, "prompt": "x", "max_tokens": 4, **fields})
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            assert reply["id"] == index
            assert fragment in reply["message"], reply
        done = done_of(await client.request(
            {"prompt": "x", "grammar": 'root ::= "ok"', "max_tokens": 4, "stream": False}))
        assert done["text"] == "ok" and done["finish_reason"] == "stop"
        stats = await client.final({"op": "stats"})
        assert stats["errors"]["invalid_request"] == len(cases)
        assert stats["errors"]["internal"] == 0
        # llama.cpp prints a rejected grammar to stderr; the daemon keeps it out of its log.
        assert "error parsing grammar" not in daemon.log


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_max_tokens_and_stop_sequences_still_apply() -> None:
    base = {"prompt": few_shot("order"), "json_schema": ORDER, "temperature": 0,
            "cache_prompt": False, "stream": False, "max_tokens": 256}
    async with running_daemon() as daemon, daemon.client() as client:
        full = done_of(await client.request(base, timeout=TIMEOUT_S))
        assert full["finish_reason"] == "stop", full
        jsonschema.validate(json.loads(full["text"]), ORDER)
        # Cut short, the text is the start of the same valid document.
        cut = done_of(await client.request({**base, "max_tokens": 6}, timeout=TIMEOUT_S))
        assert cut["finish_reason"] == "length"
        assert cut["usage"]["completion_tokens"] == 6
        assert full["text"].startswith(cut["text"]) and cut["text"] != full["text"]
        stop = '"items"'
        assert stop in full["text"]
        stopped = done_of(await client.request({**base, "stop": stop}, timeout=TIMEOUT_S))
        assert stopped["finish_reason"] == "stop_sequence"
        assert stopped["text"] == full["text"][: full["text"].find(stop)]


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_greedy_is_deterministic_seeded_is_reproducible_and_streaming_matches() -> None:
    greedy = {"prompt": few_shot("tags"), "json_schema": TAGS, "temperature": 0,
              "cache_prompt": False, "max_tokens": 200}
    seeded = {**greedy, "temperature": 1.0, "seed": 7, "repeat_penalty": 1.3}
    async with running_daemon() as daemon, daemon.client() as client:
        for request in (greedy, seeded):
            first = done_of(await client.request({**request, "stream": False}, TIMEOUT_S))
            second = done_of(await client.request({**request, "stream": False}, TIMEOUT_S))
            streamed = await client.request({**request, "stream": True}, TIMEOUT_S)
            assert first["finish_reason"] == "stop", first
            assert first["text"] == second["text"] == tokens_text(streamed)
            assert done_of(streamed)["usage"] == first["usage"]
            jsonschema.validate(json.loads(first["text"]), TAGS)


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_cancelled_queued_and_abandoned_grammar_requests_leave_the_daemon_serving() -> None:
    """The grammar of a request that never runs, and of one whose client leaves mid-run,
    is freed without upsetting the slot (a double free would crash the daemon)."""
    request = {"prompt": few_shot("person"), "json_schema": PERSON, "temperature": 1.0,
               "max_tokens": 200}
    # One slot: the second request of each pair really waits in the queue.
    async with running_daemon({"server": {"slots": 1}}) as daemon:
        async with daemon.client() as leaving:
            await leaving.start_streaming({**request, "id": "run"}, {**request, "id": "queued"})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the second grammar request queued")
        async with daemon.client() as client:
            await client.start_streaming({**request, "id": "a"}, {**request, "id": "b"})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="b queued behind a")
            await client.send({"op": "cancel", "target": "b"})
            rest = await client.reply(TIMEOUT_S)
            assert done_of(rest)["id"] == "a"
            cancelled = await client.reply(TIMEOUT_S)
            # Where it waited (behind the left request's run, too, if that had not
            # ended yet), then its done.
            assert [(line["type"], line["id"]) for line in cancelled] == [
                ("queued", "b")] * (len(cancelled) - 1) + [("done", "b")], cancelled
            assert len(cancelled) > 1 and cancelled[-2]["position"] == 1, cancelled
            assert cancelled[-1]["finish_reason"] == "cancelled"
            assert (await client.reply())[-1]["found"] is True
            done = done_of(await client.request({**request, "seed": 1, "stream": False},
                                                TIMEOUT_S))
            jsonschema.validate(json.loads(done["text"]), PERSON)
            stats = await client.final({"op": "stats"})
            assert stats["errors"]["internal"] == 0


def _constrained(schema: dict[str, Any] | None) -> dict[str, Any]:
    return {"json_schema": schema} if schema is not None else {"format": "json"}


def _check_document(text: str, schema: dict[str, Any] | None) -> None:
    document = json.loads(text)
    if schema is not None:
        jsonschema.validate(document, schema)
    else:
        assert isinstance(document, dict)


async def _shortest_tokens(client: Client, schema: dict[str, Any] | None) -> int:
    """Tokens of the shortest valid document, as the daemon's tokenizer counts them."""
    shape = shape_of(schema) if schema is not None else free_object()
    reply = await client.final({"op": "tokenize", "text": shape.shortest.decode(),
                                "add_special": False})
    return len(reply["tokens"])


@pytest.mark.asyncio
@pytest.mark.timeout(900)
async def test_tight_budgets_end_in_valid_documents_closed_early() -> None:
    """max_tokens a little above, and up to 3x, the shortest document: every reply is a
    valid document ending "stop"; those closed early say so. Below the shortest
    document the reply is cut as before ("length", not truncated)."""
    failures = []
    truncated = 0
    async with running_daemon() as daemon, daemon.client() as client:
        for name, (schema, prompt) in BUDGET_CASES.items():
            shortest = await _shortest_tokens(client, schema)
            budgets = sorted({shortest + 2, shortest * 3 // 2, shortest * 2, shortest * 3})
            requests = [{"id": f"{name}-{budget}-{seed}", "prompt": prompt, "temperature": 1.0,
                         "seed": seed, "max_tokens": budget, "stream": False,
                         **_constrained(schema)}
                        for budget in budgets for seed in range(3)]
            requests.append({"id": f"{name}-below", "prompt": prompt, "temperature": 1.0,
                             "seed": 1, "max_tokens": max(1, shortest - 2), "stream": False,
                             **_constrained(schema)})
            for request, done in zip(requests, await pipelined(client, requests), strict=True):
                if request["id"].endswith("below"):
                    if schema is not None and (done["finish_reason"] != "length"
                                               or done["truncated"]):
                        failures.append((done["id"], done))
                    continue
                truncated += done["truncated"]
                try:
                    assert done["finish_reason"] == "stop", done["finish_reason"]
                    assert done["usage"]["completion_tokens"] <= request["max_tokens"]
                    _check_document(done["text"], schema)
                except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
                    failures.append((done["id"], str(exc)[:200], done.get("text")))
        stats = await client.final({"op": "stats"})
    assert not failures, failures
    assert truncated > 0
    assert stats["grammar"]["closed_early"] == truncated


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_integer_bounds_hold_at_their_edges() -> None:
    prompt = ('Numbers as JSON.\nExample: {"level": 9, "delta": 5, "year": 1899, '
              '"debt": -9}\nExample: {"level": 2, "delta": -5, "year": 2101, '
              '"debt": 0}\nExample: ')
    async with running_daemon() as daemon, daemon.client() as client:
        requests = [{"id": seed, "prompt": prompt, "json_schema": BOUNDED, "temperature": 1.0,
                     "seed": seed, "max_tokens": 60, "stream": False} for seed in range(24)]
        values: dict[str, set[int]] = {key: set() for key in BOUNDED["properties"]}
        for done in await pipelined(client, requests):
            assert done["finish_reason"] == "stop", done
            document = json.loads(done["text"])
            jsonschema.validate(document, BOUNDED)
            for key, value in document.items():
                values[key].add(value)
    # The prompt pulls toward values just outside; the grammar keeps them inside.
    assert values["level"] <= set(range(3, 8)) and values["delta"] <= set(range(-4, 5))
    assert all(1900 <= year <= 2100 for year in values["year"])
    assert all(debt <= -10 for debt in values["debt"])


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_closing_early_is_deterministic_and_a_document_whole_at_the_limit_stops() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        shortest = await _shortest_tokens(client, LEGS)
        request = {"prompt": BUDGET_CASES["legs"][1], "json_schema": LEGS, "temperature": 1.0,
                   "seed": 3, "max_tokens": shortest * 2, "cache_prompt": False,
                   "stream": False}
        first = done_of(await client.request(request, TIMEOUT_S))
        second = done_of(await client.request(request, TIMEOUT_S))
        assert (first["text"], first["finish_reason"], first["truncated"]) == (
            second["text"], second["finish_reason"], second["truncated"])
        _check_document(first["text"], LEGS)
        # The same document with exactly its own length as the budget: "stop", not
        # "length", though no end-of-generation token was drawn.
        used = first["usage"]["completion_tokens"]
        exact = done_of(await client.request({**request, "max_tokens": used}, TIMEOUT_S))
        assert exact["text"] == first["text"] and exact["finish_reason"] == "stop", exact
        # A GBNF grammar is not closed early: cut by max_tokens it says "length".
        cut = done_of(await client.request(
            {"prompt": "List:", "grammar": 'root ::= ("- " [a-z]{1,8} "\\n"){3}',
             "temperature": 1.0, "seed": 1, "max_tokens": 4, "stream": False}, TIMEOUT_S))
        assert cut["finish_reason"] == "length" and not cut["truncated"], cut


@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_item_and_length_bounds_beyond_256() -> None:
    digits = {"type": "object", "properties": {
        "nums": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "minItems": 260, "maxItems": 1000}},
        "required": ["nums"]}
    essay = {"type": "object", "properties": {
        "essay": {"type": "string", "minLength": 300, "maxLength": 2000}},
        "required": ["essay"]}
    async with running_daemon() as daemon, daemon.client() as client:
        for schema, budget in ((digits, 700), (essay, 400)):
            done = done_of(await client.request(
                {"prompt": "Digits as JSON:", "json_schema": schema, "temperature": 1.0,
                 "seed": 1, "max_tokens": budget, "stream": False}, TIMEOUT_S))
            assert done["finish_reason"] == "stop", done
            jsonschema.validate(json.loads(done["text"]), schema)
