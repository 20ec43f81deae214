"""OpenAI's Responses API (`/v1/responses`), end to end: the real daemon and the real
`openai` SDK (`client.responses.create` / `.stream`), and one agent loop of the
`openai-agents` SDK, offline.

One daemon on a TCP port (reproducible mode, so that a greedy request gives the same
bytes whole and streamed), shared by the module's tests.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.kit.http import (
    MODEL_ID,
    PERSON,
    WAIT_S,
    Endpoint,
    endpoint,
    module_test,
    raises,
)
from tests.kit.tools import PARAMETERS, WEATHER, local_result

QUESTION = "Name three colors of the rainbow."
# The Responses API's flat tool shape.
TOOL = {"type": "function", **WEATHER["function"]}

SDK_WAIT_S = 3 * WAIT_S


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp() -> AsyncIterator[Endpoint]:
    config = {"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 2},
              "model": {"reproducible": True}}
    async with endpoint(config) as found:
        yield found


def sdk(found: Endpoint) -> openai.AsyncOpenAI:
    """The SDK's client, with room for a loaded 2-core machine: some requests here
    generate 64 tokens under a JSON Schema or a tools grammar (still bounded)."""
    return found.sdk().with_options(timeout=SDK_WAIT_S)


def output_text(response: Any) -> str:
    return "".join(part.text for item in response.output if item.type == "message"
                   for part in item.content if part.type == "output_text")


@module_test
async def test_text_whole_and_streamed_are_the_same(tcp: Endpoint) -> None:
    # Cut at the first line (a stop string, as llama-server takes them), so that the
    # response completes rather than runs to max_output_tokens.
    options: dict[str, Any] = {"model": MODEL_ID, "input": QUESTION, "max_output_tokens": 96,
                               "temperature": 0, "extra_body": {"stop": ["\n"]}}
    async with sdk(tcp) as client:
        whole = await client.responses.create(**options)
        events = [event async for event in await client.responses.create(**options,
                                                                          stream=True)]
        async with client.responses.stream(**options) as stream:
            helper_events = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.model == MODEL_ID and whole.instructions is None
    assert whole.output_text and whole.output_text == output_text(whole)
    assert whole.status == "completed", whole.output_text
    usage = whole.usage
    assert usage is not None and usage.output_tokens > 0 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The documented sequence, numbered from 0.
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", last]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(event.delta for event in events if event.type.endswith("text.delta"))
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    assert {event.response.id for event in events  # type: ignore[union-attr]
            if event.type.startswith("response.") and hasattr(event, "response")} \
        == {events[0].response.id}  # type: ignore[union-attr]
    assert helper_events == kinds
    assert final.output_text == whole.output_text


@module_test
async def test_a_tool_round_trip_with_previous_response_id(tcp: Endpoint) -> None:
    question = "What is the weather in Paris?"
    async with sdk(tcp) as client:
        first = await client.responses.create(
            model=MODEL_ID, input=question, tools=[TOOL], tool_choice="required",
            max_output_tokens=64, temperature=0)
        calls = [item for item in first.output if item.type == "function_call"]
        assert calls and first.status == "completed", first.output
        outputs = []
        for call in calls:
            assert call.name == "get_weather" and call.call_id
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, PARAMETERS["get_weather"])
            outputs.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": local_result(call.name, arguments)})
        # The next turn names the first; only the results are sent.
        answer = await client.responses.create(
            model=MODEL_ID, previous_response_id=first.id, input=outputs, tools=[TOOL],
            tool_choice="none", max_output_tokens=32, temperature=0)
        # The same turn sent whole is the same prompt, and gives the same answer.
        again = await client.responses.create(
            model=MODEL_ID, tools=[TOOL], tool_choice="none", max_output_tokens=32,
            temperature=0,
            input=[{"role": "user", "content": question},
                   *[item.model_dump(exclude_none=True) for item in calls], *outputs])
    assert answer.output_text and answer.previous_response_id == first.id
    assert not [item for item in answer.output if item.type == "function_call"]
    assert answer.usage is not None and again.usage is not None
    assert answer.usage.input_tokens == again.usage.input_tokens
    assert again.output_text == answer.output_text


@module_test
async def test_a_streamed_call_and_a_named_function(tcp: Endpoint) -> None:
    async with sdk(tcp) as client, client.responses.stream(
            model=MODEL_ID, input="Weather in Oslo, in f please.", tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False, max_output_tokens=64) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS["get_weather"])
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]


@module_test
async def test_structured_output_json_schema_and_json_object(tcp: Endpoint) -> None:
    async with sdk(tcp) as client:
        reply = await client.responses.create(
            model=MODEL_ID, input="Describe a person as JSON.", max_output_tokens=64,
            temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                            "schema": PERSON, "strict": True}})
        jsonschema.validate(json.loads(reply.output_text), PERSON)
        assert reply.text is not None and reply.text.format is not None
        assert reply.text.format.type == "json_schema"
        # Closed to fit even a budget the document would overrun.
        short = await client.responses.create(
            model=MODEL_ID, input="Describe a person as JSON.", max_output_tokens=8,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
        jsonschema.validate(json.loads(short.output_text), PERSON)
        # Streamed; at max_output_tokens too the object is closed to fit (`incomplete`).
        events = [event async for event in await client.responses.create(
            model=MODEL_ID, input="Give me a JSON object about cats.", max_output_tokens=48,
            text={"format": {"type": "json_object"}}, stream=True)]
        final = events[-1].response  # type: ignore[union-attr]
        assert events[-1].type in ("response.completed", "response.incomplete")
        text = "".join(event.delta for event in events  # type: ignore[union-attr]
                       if event.type == "response.output_text.delta")
        assert text == final.output_text and isinstance(json.loads(text), dict)


@module_test
async def test_logprobs_when_included(tcp: Endpoint) -> None:
    async with sdk(tcp) as client:
        reply = await client.responses.create(
            model=MODEL_ID, input=QUESTION, max_output_tokens=8, temperature=0,
            top_logprobs=2, include=["message.output_text.logprobs"])
        plain = await client.responses.create(model=MODEL_ID, input=QUESTION,
                                              max_output_tokens=8, temperature=0)
    part = reply.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and reply.usage is not None
    assert len(part.logprobs) == reply.usage.output_tokens
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token  # greedy
    assert b"".join(bytes(entry.bytes) for entry in part.logprobs).decode() == reply.output_text
    assert plain.output[0].content[0].logprobs is None  # type: ignore[union-attr]


@module_test
async def test_stored_responses_get_delete_and_404(tcp: Endpoint) -> None:
    async with sdk(tcp) as client:
        first = await client.responses.create(model=MODEL_ID, input="Hi!",
                                              max_output_tokens=4, metadata={"k": "v"})
        fetched = await client.responses.retrieve(first.id)
        assert fetched.id == first.id and fetched.output_text == first.output_text
        assert fetched.metadata == {"k": "v"}
        unstored = await client.responses.create(model=MODEL_ID, input="Hi!",
                                                 max_output_tokens=4, store=False)
        for missing in (unstored.id, "resp_unknown"):
            error = await raises(client.responses.retrieve(missing), openai.NotFoundError)
            assert error.code == "not_found"
            error = await raises(client.responses.create(
                model=MODEL_ID, input="And?", previous_response_id=missing),
                openai.NotFoundError)
            assert error.code == "previous_response_not_found"
            assert error.param == "previous_response_id"
        await client.responses.delete(first.id)
        await raises(client.responses.retrieve(first.id), openai.NotFoundError)
        await raises(client.responses.delete(first.id), openai.NotFoundError)


@module_test
async def test_bad_values_are_400_naming_the_field(tcp: Endpoint) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": QUESTION, "temperature": 5}, "temperature"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": []}, "input"),
        ({"input": QUESTION, "max_output_tokens": "many"}, "max_output_tokens"),
        ({"input": QUESTION, "conversation": "conv_1"}, "conversation"),
        ({"input": QUESTION, "tool_choice": "required"}, "tool_choice"),
    ]
    async with sdk(tcp) as client:
        for options, param in cases:
            error = await raises(client.responses.create(model=MODEL_ID, **options),
                                 openai.BadRequestError)
            assert error.param == param, (options, error.body)
            assert isinstance(error.body, dict) and error.body["message"]
        # Unknown fields, and reasoning settings the model has no use for, are ignored.
        reply = await client.responses.create(
            model=MODEL_ID, input=QUESTION, max_output_tokens=2, reasoning={"effort": "low"},
            extra_body={"some_future_field": {"x": 1}})
        assert reply.status == "incomplete"
        assert reply.incomplete_details is not None
        assert reply.incomplete_details.reason == "max_output_tokens"


@module_test
async def test_an_agent_loop_of_the_agents_sdk(tcp: Endpoint) -> None:
    """The agents SDK's Runner against the daemon (its default model class speaks the
    Responses API): the model calls a local function tool, the SDK runs it, and a second
    agent answers from the conversation with the tool's result in it."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    called: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        called.append(city)
        return local_result("get_weather", {"city": city})

    async with sdk(tcp) as client:
        model = agents.OpenAIResponsesModel(model=MODEL_ID, openai_client=client)
        caller = agents.Agent(
            name="caller", model=model, tools=[get_weather],
            tool_use_behavior="stop_on_first_tool",
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                parallel_tool_calls=False, max_tokens=48))
        called_once = await agents.Runner.run(caller, "What is the weather in Paris?",
                                              max_turns=2)
        assert len(called) == 1 and called_once.final_output == local_result(
            "get_weather", {"city": called[0]})
        # Cut at the end of its first sentence (a stop string): the SDK takes a response
        # cut at max_output_tokens (`incomplete`) for an error.
        answerer = agents.Agent(name="answerer", model=model,
                                model_settings=agents.ModelSettings(
                                    temperature=0, max_tokens=64,
                                    extra_body={"stop": [".", "\n"]}))
        answered = await agents.Runner.run(answerer, called_once.to_input_list(), max_turns=1)
    kinds = [item.get("type") for item in called_once.to_input_list()]
    assert "function_call" in kinds and "function_call_output" in kinds
    assert isinstance(answered.final_output, str) and answered.final_output
    assert WAIT_S  # every SDK call above is bounded by the client's timeout


@module_test
async def test_a_conversation_by_previous_response_id_starts_each_turn_warm() -> None:
    """Each turn sends only its new message; the prompt it renders to starts with the
    last turn's, whose state the prompt store kept (a daemon of its own: the module's
    is reproducible, and keeps no states)."""
    instructions = "You are a helpful assistant. " + " ".join(
        f"Rule {number}: answer in plain words, and keep each answer short."
        for number in range(40))  # past [cache] min_tokens (256)
    config = {"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 1}}
    turns = []
    async with endpoint(config) as found, sdk(found) as client:
        previous: str | None = None
        for question in ("My name is Ann.", "What is my name?", "Say it once more."):
            reply = await client.responses.create(
                model=MODEL_ID, instructions=instructions, input=question,
                previous_response_id=previous, max_output_tokens=8, temperature=0)
            assert reply.usage is not None
            turns.append(reply.usage)
            previous = reply.id
    assert turns[0].input_tokens > 256
    for before, after in itertools.pairwise(turns):
        assert after.input_tokens > before.input_tokens + before.output_tokens
        assert after.input_tokens_details.cached_tokens >= before.input_tokens, turns
