"""Tool calls: the calls a chat answers with parse and validate, over NDJSON and OpenAI's API.

The live tests run the real daemon and model: with `tool_choice` "required" or a named
function every answer is a call whose name is one of the tools and whose arguments are
valid against that tool's parameters, at temperature 1.0 over many seeds and at a
max_tokens that leaves no room to spare (budget-aware closing ends the call in time).
The pure parts (the marker split of streamed text, the plan, reading calls) get
property tests.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/core/test_tools.py.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.kit import REPLY_TIMEOUT_S, running_daemon
from tests.kit.tools import ADD, CALLED, PARAMETERS, QUESTION, TOOLS

# The shortest call of these tools takes 15 tokens: 16 leaves one to spare.
TIGHT = 16
SEEDS = range(12)


def assert_valid_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        function = call["function"]
        assert function["name"] in names
        jsonschema.validate(function["arguments"], PARAMETERS[function["name"]])


async def answers(client: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Send all, pipelined; the final line of each, by id."""
    await client.send(*requests)
    finals = {}
    for _ in requests:
        reply = await client.recv(timeout=REPLY_TIMEOUT_S * 2)
        assert reply is not None
        while reply["type"] == "token":
            reply = await client.recv(timeout=REPLY_TIMEOUT_S * 2)
            assert reply is not None
        finals[reply["id"]] = reply
    return [finals[request["id"]] for request in requests]


def chat(seed: int, choice: Any, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"op": "chat", "id": seed, "messages": QUESTION, "tools": TOOLS,
            "tool_choice": choice, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "stream": False, **extra}


@pytest.mark.asyncio
async def test_forced_calls_always_parse_and_validate_over_ndjson() -> None:
    async with running_daemon({"server": {"slots": 8}}) as daemon, daemon.client() as client:
        for max_tokens in (TIGHT, 64):
            required = await answers(client, [chat(seed, "required", max_tokens)
                                              for seed in SEEDS])
            for done in required:
                assert done["type"] == "done", done
                assert done["finish_reason"] == "tool_calls", done
                assert_valid_calls(done["tool_calls"], {"get_weather", "add"})
                assert done["usage"]["completion_tokens"] <= max_tokens
        named = {"type": "function", "function": {"name": "add"}}
        for done in await answers(client, [chat(seed, named, TIGHT) for seed in SEEDS]):
            assert done["finish_reason"] == "tool_calls", done
            assert len(done["tool_calls"]) == 1
            assert_valid_calls(done["tool_calls"], {"add"})
        one = await answers(client, [chat(seed, "required", 64, parallel_tool_calls=False)
                                     for seed in range(4)])
        assert all(len(done["tool_calls"]) == 1 for done in one)
        # "auto": text, or calls that validate; "none": text only.
        for done in await answers(client, [chat(seed, "auto", 48) for seed in range(6)]):
            assert done["type"] == "done"
            if done["finish_reason"] == "tool_calls":
                assert_valid_calls(done["tool_calls"], {"get_weather", "add"})
            else:
                assert "tool_calls" not in done
        for done in await answers(client, [chat(seed, "none", 16) for seed in range(2)]):
            assert "tool_calls" not in done and done["finish_reason"] != "tool_calls"
        # A conversation with a call and its result is taken, and answered.
        done = await client.final({"op": "chat", "messages": CALLED, "tools": TOOLS,
                                   "max_tokens": 24, "temperature": 0})
        assert done["type"] == "done" and done["finish_reason"] in ("stop", "length",
                                                                     "tool_calls")


@pytest.mark.asyncio
async def test_tools_that_cannot_be_offered_are_refused_with_the_field() -> None:
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}
    cases = [
        ({"tools": [bad_schema]}, "$.tools[0].function.parameters.properties.x.type"),
        ({"tools": [ADD, ADD]}, "$.tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "$.tool_choice.function.name"),
        ({"tool_choice": "required"}, "$.tool_choice"),
        ({"tools": TOOLS, "format": "json"}, "exclude each other"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
         "$.tools[0].function.name"),
        # `$` would match before the final newline; the whole name must match.
        ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]},
         "$.tools[0].function.name"),
    ]
    async with running_daemon() as daemon, daemon.client() as client:
        for fields, where in cases:
            reply = await client.final({"op": "chat", "messages": QUESTION, **fields})
            assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
            assert where in reply["message"], reply
        done = await client.final(chat(1, "required", TIGHT))
        assert done["finish_reason"] == "tool_calls"


@pytest.mark.asyncio
async def test_the_openai_endpoint_calls_streams_and_takes_results() -> None:
    async with running_daemon({"openai": {"listen": "127.0.0.1:0"}}) as daemon:
        ready = next(note for note in daemon.notifications if note.startswith("READY=1"))
        url = ready.split("OpenAI API on ")[1].strip()
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      timeout=REPLY_TIMEOUT_S) as api:
            asked: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": TOOLS,
                                     "tool_choice": "required", "max_tokens": 48,
                                     "temperature": 0}
            whole = await api.chat.completions.create(**asked)
            choice = whole.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.type == "function"
                jsonschema.validate(json.loads(call.function.arguments),
                                    PARAMETERS[call.function.name])
            # Streamed deltas join to the same calls (greedy: the same answer).
            joined: dict[int, dict[str, str]] = {}
            finish = None
            async with await api.chat.completions.create(**asked, stream=True) as stream:
                async for chunk in stream:
                    if not chunk.choices:
                        continue
                    for delta in chunk.choices[0].delta.tool_calls or []:
                        entry = joined.setdefault(delta.index, {"name": "", "arguments": ""})
                        assert delta.function is not None
                        entry["name"] += delta.function.name or ""
                        entry["arguments"] += delta.function.arguments or ""
                    finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls"
            assert [joined[index] for index in sorted(joined)] == [
                {"name": call.function.name, "arguments": call.function.arguments}
                for call in choice.message.tool_calls]
            # The round trip: the call and its result go back; the answer is accepted.
            first = choice.message.tool_calls[0]
            history = [*QUESTION, {"role": "assistant", "content": None,
                                   "tool_calls": [first.model_dump()]},
                       {"role": "tool", "tool_call_id": first.id, "content": "21 C, sunny"}]
            final = await api.chat.completions.create(
                model="m", messages=history, tools=TOOLS, max_tokens=24, temperature=0)
            assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
            # A call's arguments that are not a JSON object: 400 naming them.
            broken = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function",
                 "function": {"name": "add", "arguments": "[1, 2]"}}]}]
            with pytest.raises(openai.BadRequestError) as caught:
                await api.chat.completions.create(model="m", messages=broken,
                                                  tools=TOOLS, max_tokens=4)
            assert caught.value.body is not None
            assert "tool_calls[0].function.arguments" in json.dumps(caught.value.body)


