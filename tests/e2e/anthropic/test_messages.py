"""Anthropic's Messages API on the HTTP listener, end to end: the real daemon, the real
`anthropic` SDK (`messages.create`, `messages.stream`, `messages.count_tokens`), and raw
HTTP where the SDK would hide what is checked (the events' order, `x-api-key`, bodies
the SDK would not send).

One daemon for the module (TCP, an API key, reproducible mode so that a greedy request
gives the same bytes whole and streamed, a small max_line_bytes for the 413).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import jsonschema
import pytest
import pytest_asyncio

from tests.kit.http import Endpoint, endpoint
from tests.kit.tools import ADD, WEATHER, local_result

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "messages-key"
# Generous: a grammar-held call on a loaded 2-core machine takes tens of seconds.
WAIT_S = 180.0
MAX_LINE_BYTES = 16384
COLORS: list[Any] = [{"role": "user", "content": "Name three colors of the rainbow."}]
GREEDY: dict[str, Any] = {"temperature": 0}
# The tools of the Chat Completions tests, in the Messages shape.
TOOLS: list[dict[str, Any]] = [
    {"name": tool["function"]["name"], "description": tool["function"]["description"],
     "input_schema": tool["function"]["parameters"]} for tool in (WEATHER, ADD)]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
ASK_WEATHER: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon() -> AsyncIterator[Endpoint]:
    config = {"openai": {"listen": "127.0.0.1:0", "api_key": KEY},
              "server": {"slots": 2, "max_line_bytes": MAX_LINE_BYTES},
              "model": {"reproducible": True}}
    async with endpoint(config) as found:
        yield found


def sdk(found: Endpoint, api_key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=found.url, api_key=api_key, max_retries=0,
                                    timeout=WAIT_S)


async def post(found: Endpoint, path: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    """A raw POST with the key as `x-api-key` (Claude Code's way); status, JSON, text."""
    async with found.http() as http:
        response = await http.post(
            path, content=body if isinstance(body, bytes) else json.dumps(body),
            headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                     "Content-Type": "application/json", **(headers or {})})
        text = response.text
        return response.status_code, (json.loads(text) if text.startswith("{") else None), text


def assert_error(status: int, body: Any, expected_status: int, kind: str,
                 *mentions: str) -> None:
    """Anthropic's error shape, exactly: its type, and a message naming what it must."""
    assert status == expected_status, body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    for mention in mentions:
        assert mention in body["error"]["message"], body


def events_of(stream: str) -> list[tuple[str, dict[str, Any]]]:
    """A server-sent event stream as (event, data) pairs; each data's type is its event."""
    pairs = []
    for block in stream.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") \
            and lines[1].startswith("data: "), block
        kind, data = lines[0].removeprefix("event: "), json.loads(lines[1][6:])
        assert data["type"] == kind, block
        pairs.append((kind, data))
    return pairs


async def metric(found: Endpoint, op: str, api: str) -> float:
    async with found.http() as http:
        text = (await http.get("/metrics", headers={"x-api-key": KEY})).text
    match = re.search(rf'^sfcore_requests_total{{api="{api}",op="{op}"}} (\S+)$', text, re.M)
    assert match, text
    return float(match[1])


# --- text ---------------------------------------------------------------------------------


async def test_text_whole_and_streamed_are_the_same_message(daemon: Endpoint) -> None:
    before = await metric(daemon, "chat", "messages")
    options: dict[str, Any] = {"model": "any-name", "max_tokens": 16, "messages": COLORS,
                               "system": [{"type": "text", "text": "Answer briefly."}],
                               "extra_body": GREEDY}
    async with sdk(daemon) as client:
        whole = await client.messages.create(**options)
        async with client.messages.stream(**options) as stream:
            streamed_text = "".join([text async for text in stream.text_stream])
            streamed = await stream.get_final_message()
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.id.startswith("msg_") and whole.model == "gemma-3-270m-q4_k_m"
    assert [block.type for block in whole.content] == ["text"]
    text = whole.content[0].text
    assert text and streamed_text == text
    assert [block.type for block in streamed.content] == ["text"]
    assert streamed.content[0].text == text
    assert whole.stop_reason == streamed.stop_reason
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.stop_sequence is None
    # The prompt's whole count, however much of it the cache gave.
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == \
        streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) > 0
    assert whole.usage.output_tokens == streamed.usage.output_tokens
    if whole.stop_reason == "max_tokens":
        assert whole.usage.output_tokens == 16
    assert await metric(daemon, "chat", "messages") == before + 2


async def test_the_stream_is_anthropic_s_event_sequence(daemon: Endpoint) -> None:
    status, _, text = await post(daemon, "/v1/messages", {
        "model": "m", "max_tokens": 8, "messages": COLORS, "stream": True, **GREEDY})
    assert status == 200, text
    events = events_of(text)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[2] == "content_block_start" and kinds[-4:] == [
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 0 and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
    assert all(delta["type"] == "text_delta" and delta["text"] for delta in deltas)
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    # No cache mark: nothing written; what the slot's cells gave is read.
    usage = end["usage"]
    assert usage["output_tokens"] == 8 and usage["cache_creation_input_tokens"] == 0
    assert set(usage) == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                          "cache_read_input_tokens"}
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == \
        start["usage"]["input_tokens"]


async def test_a_stop_sequence_ends_the_message_and_is_named(daemon: Endpoint) -> None:
    options: dict[str, Any] = {"model": "m", "max_tokens": 24, "messages": COLORS,
                               "extra_body": GREEDY}
    async with sdk(daemon) as client:
        free = await client.messages.create(**options)
        text = free.content[0].text
        assert len(text) > 12, text
        stop = text[8:11]
        expected = text[:text.index(stop)]
        options["stop_sequences"] = [stop, "never written here"]
        whole = await client.messages.create(**options)
        async with client.messages.stream(**options) as stream:
            streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert message.content[0].text == expected


# --- tools --------------------------------------------------------------------------------


def check_calls(message: anthropic.types.Message, names: set[str]) -> list[Any]:
    """The message is calls, each of one of `names` with an input valid for it."""
    assert message.stop_reason == "tool_use", message
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls, message
    for call in calls:
        assert call.id.startswith("toolu_") and call.name in names, call
        jsonschema.validate(call.input, SCHEMAS[call.name])
    assert len({call.id for call in calls}) == len(calls)
    return calls


async def test_a_tool_round_trip(daemon: Endpoint) -> None:
    async with sdk(daemon) as client:
        first = await client.messages.create(
            model="m", max_tokens=40, messages=ASK_WEATHER, tools=TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
        calls = check_calls(first, {"get_weather", "add"})
        assert len(calls) == 1
        results = [{"type": "tool_result", "tool_use_id": call.id,
                    "content": local_result(call.name, call.input)} for call in calls]
        turns: list[Any] = [*ASK_WEATHER, first.to_param(), {"role": "user", "content": results}]
        async with client.messages.stream(
                model="m", max_tokens=24, messages=turns, tools=TOOLS,
                tool_choice={"type": "none"}, extra_body=GREEDY) as stream:
            answer = await stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens"), answer
    assert [block.type for block in answer.content] == ["text"]


async def test_tool_choice_tool_streams_one_call(daemon: Endpoint) -> None:
    async with sdk(daemon) as client:
        async with client.messages.stream(
                model="m", max_tokens=32, tools=TOOLS,
                messages=[{"role": "user", "content": "Add 2 and 3."}],
                tool_choice={"type": "tool", "name": "add"}) as stream:
            kinds = [event.type async for event in stream]
            forced = await stream.get_final_message()
    assert len(check_calls(forced, {"add"})) == 1
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds  # the SDK's event for an input_json_delta


# --- count_tokens ---------------------------------------------------------------------


async def test_count_tokens_is_the_input_tokens_of_the_same_request(daemon: Endpoint) -> None:
    history: list[Any] = [
        *ASK_WEATHER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "a call", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Paris: 21 C, sunny"}]},
            {"type": "text", "text": "And in Rome?"}]}]
    bodies: list[dict[str, Any]] = [
        {"messages": COLORS},
        {"messages": COLORS, "system": "Be brief."},
        {"messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": {"type": "any"}},
        {"messages": ASK_WEATHER, "tools": TOOLS,
         "tool_choice": {"type": "tool", "name": "get_weather"}},
        {"messages": history, "tools": TOOLS, "system": [{"type": "text", "text": "Hi."}]},
    ]
    counts = []
    async with sdk(daemon) as client:
        for body in bodies:
            counted = await client.messages.count_tokens(model="m", **body)
            made = await client.messages.create(model="m", max_tokens=1, **body)
            assert counted.input_tokens == made.usage.input_tokens + (
                made.usage.cache_read_input_tokens or 0), body
            counts.append(counted.input_tokens)
    # Each part of the prompt counts: a system prompt, tools, a forced call's opening.
    assert counts[1] > counts[0] and counts[2] > counts[0] and counts[3] > counts[0]
    status, body, _ = await post(daemon, "/v1/messages/count_tokens",
                                 {"model": "m", "messages": [{"role": "system"}]})
    assert_error(status, body, 400, "invalid_request_error", "content")


# --- errors -------------------------------------------------------------------------------


async def test_errors_are_in_anthropic_s_shape(daemon: Endpoint) -> None:
    hi: list[Any] = [{"role": "user", "content": "hi"}]
    refused: list[tuple[dict[str, Any], str]] = [
        ({"messages": hi}, "max_tokens"),
        ({"messages": hi, "max_tokens": "3"}, "max_tokens"),
        ({"messages": hi, "max_tokens": 0}, "max_tokens"),
        ({"messages": hi, "max_tokens": 3, "temperature": "hot"}, "temperature"),
        ({"messages": hi, "max_tokens": 3, "top_k": -1}, "top_k"),
        ({"messages": hi, "max_tokens": 3, "stop_sequences": ["x"] * 9}, "stop_sequences"),
        ({"messages": "hi", "max_tokens": 3}, "messages"),
        ({"messages": [{"role": "user", "content": 5}], "max_tokens": 3},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
          "max_tokens": 3}, "messages[0].content[0].type"),
        ({"messages": hi, "max_tokens": 3, "tools": [
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
         "web_search"),
        ({"messages": hi, "max_tokens": 3, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"messages": hi, "max_tokens": 3, "tools": [
            {"name": "bad", "input_schema": {"type": "object", "allOf": [{"type": "object"}]}}]},
         "tools[0].input_schema"),
    ]
    for body, field in refused:
        status, reply, _ = await post(daemon, "/v1/messages", {"model": "m", **body})
        assert_error(status, reply, 400, "invalid_request_error", field)
    # An agent's tool as its own validator wants it (Claude Code's web fetch has a "uri"
    # format): what the grammar cannot enforce is relaxed, not refused
    # (structured/lenient.py), and the call holds to the rest.
    fetch = {"name": "fetch", "input_schema": {
        "type": "object", "required": ["url"], "additionalProperties": False,
        "properties": {"url": {"type": "string", "format": "uri"},
                       "timeout": {"type": "number", "maximum": 600}},
        "propertyNames": {"pattern": "^[a-z]+$"}}}
    status, reply, _ = await post(daemon, "/v1/messages", {
        "model": "m", "messages": [{"role": "user", "content": "Fetch example.com"}],
        "max_tokens": 48, "tools": [fetch], "tool_choice": {"type": "tool", "name": "fetch"}})
    assert status == 200, reply
    call = reply["content"][-1]
    assert call["type"] == "tool_use" and call["name"] == "fetch"
    assert isinstance(call["input"]["url"], str) and set(call["input"]) <= {"url", "timeout"}
    status, reply, _ = await post(daemon, "/v1/messages", b"{not json")
    assert_error(status, reply, 400, "invalid_request_error")
    status, reply, _ = await post(daemon, "/v1/messages", {"messages": hi, "max_tokens": 3},
                                  {"x-api-key": "wrong"})
    assert_error(status, reply, 401, "authentication_error", "x-api-key")
    status, reply, _ = await post(daemon, "/v1/messages/nowhere", {})
    assert_error(status, reply, 404, "not_found_error")
    status, reply, _ = await post(daemon, "/v1/messages", {
        "messages": [{"role": "user", "content": "x" * MAX_LINE_BYTES}], "max_tokens": 3})
    assert_error(status, reply, 413, "invalid_request_error", "max_line_bytes")
    # Unknown fields and Anthropic's extended ones are taken and ignored.
    status, reply, _ = await post(daemon, "/v1/messages", {
        "model": "m", "messages": hi, "max_tokens": 2, "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "service_tier": "auto",
        "a_field_from_2027": [1]})
    assert status == 200 and reply["type"] == "message", reply
    async with sdk(daemon, api_key="wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await client.messages.create(model="m", max_tokens=2, messages=hi)
    assert caught.value.body["error"]["type"] == "authentication_error"
    async with sdk(daemon) as client:
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model="m", max_tokens=2, messages=hi,
                                         extra_body={"top_p": 2})
    assert "top_p" in bad.value.message
    # The OpenAI routes keep OpenAI's shape, and take the key as x-api-key too.
    async with httpx2.AsyncClient(base_url=daemon.url, timeout=WAIT_S) as http:
        response = await http.post("/v1/chat/completions", json={"messages": 1},
                                    headers={"x-api-key": KEY})
    assert response.status_code == 400 and set(response.json()["error"]) == {
        "message", "type", "param", "code"}
