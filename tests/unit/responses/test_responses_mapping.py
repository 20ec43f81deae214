"""The Responses API's pure logic (responses/), fast: whatever a client sends
to /v1/responses is decoded and mapped or refused with a 400 naming the field, never a
crash; what maps is a chat request the NDJSON side would accept; the streamed events
are numbered and in the documented order (the store: test_stored.py)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core.request import ChatRequest, FunctionCall, Message, ToolCall
from sfcore_daemon.core.result import Result, Timings, Usage
from sfcore_daemon.openai.translate import ApiError
from sfcore_daemon.responses.reply import ResponsesShape
from sfcore_daemon.responses.schema import ResponsesRequest, responses_decoder
from sfcore_daemon.responses.translate import responses_request
from tests.kit.mapping import FAST, as_ndjson, check_refusal, json_values

FIELDS = ["model", "input", "instructions", "previous_response_id", "store", "stream",
          "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
          "temperature", "top_p", "top_logprobs", "include", "metadata", "reasoning",
          "conversation", "background", "stop", "seed", "top_k", "user", "truncation"]
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
near_values = json_values | st.sampled_from([
    "hi", "", [], [{"role": "user", "content": "hi"}], [{"content": "hi"}],
    [{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                           "text": "x"}]}],
    [{"role": "assistant", "content": [{"type": "output_text", "text": "a",
                                        "annotations": []}]}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    [CALL], [CALL, RESULT], [RESULT], [{**CALL, "arguments": "[1]"}], [{**CALL, "name": ""}],
    [{**RESULT, "call_id": ""}], [{"type": "reasoning", "summary": []}],
    [{"type": "item_reference", "id": "x"}], [{"type": "function_call_output"}],
    [WEATHER], [{"type": "web_search"}], [{"type": "function"}],
    "auto", "none", "required", {"type": "function", "name": "get_weather"},
    {"type": "function"}, {"type": "file_search"},
    {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    {"format": {"type": "json_schema", "schema": False}}, {"format": {"type": "json_object"}},
    {"format": {"type": "text"}}, ["message.output_text.logprobs"], {"effort": "low"},
    ["a"] * 9, 0, 1, 20, 21, -1, 2**31, 0.5, 2.5, True, False,
])


def bodies(base: dict[str, Any] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    changes = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), near_values,
                              max_size=6 if base is None else 3)
    return changes if base is None else changes.map(lambda change: {**base, **change})


def decode(body: dict[str, Any]) -> ResponsesRequest:
    return responses_decoder.decode(msgspec.json.encode(body))


def mapped(body: dict[str, Any], history: list[Message] | None = None) -> ChatRequest:
    return responses_request(decode(body), "r", history or []).request


@FAST
@given(bodies() | bodies({"input": [CALL, RESULT], "tools": [WEATHER]}) | bodies({"input": "hi"}))
def test_any_body_is_mapped_or_refused_with_a_400(body: dict[str, Any]) -> None:
    try:
        request = responses_request(decode(body), "r", [])
    except msgspec.ValidationError as error:
        # The route answers 400 with the path msgspec names as `param`.
        assert ApiError.invalid(str(error)).param or "Object" in str(error), error
        return
    except ApiError as error:
        check_refusal(error)
        assert error.param, error.message
        return
    decoded = as_ndjson(request.request)
    assert isinstance(decoded, ChatRequest) and decoded.messages
    assert request.request.messages[-len(request.conversation):] == request.conversation


def test_items_map_onto_messages() -> None:
    request = mapped({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": "{}"}, RESULT,
        {"type": "reasoning", "summary": []},
        {"role": "developer", "content": [{"type": "input_text", "text": "x"},
                                          {"type": "input_text", "text": "y"}]}]})
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", "Let me look."),
        ("tool", "21 C"), ("system", "x\ny")]
    calls = request.messages[2].tool_calls
    assert calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_weather", {})]
    assert request.messages[3].tool_call_id == "call_1"


def test_options_map_field_for_field() -> None:
    request = mapped({"input": "hi", "tools": [WEATHER], "tool_choice": {
        "type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stop": "\n", "seed": -1,
        "include": ["message.output_text.logprobs"], "top_logprobs": 3, "stream": True,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}}}})
    assert request.tool_choice is not None and not isinstance(request.tool_choice, str)
    assert request.tool_choice.function.name == "get_weather"
    assert request.parallel_tool_calls is False and request.tools is not None
    assert (request.max_tokens, request.temperature, request.top_p, request.stop,
            request.logprobs, request.stream) == (9, 0.5, 0.9, ["\n"], 3, True)
    assert request.seed is not None and request.seed >= 0
    assert request.json_schema == {"type": "object"}
    assert mapped({"input": "hi", "text": {"format": {"type": "json_object"}}}).format == "json"
    # top_logprobs alone asks for nothing: logprobs come with `include`.
    assert mapped({"input": "hi", "top_logprobs": 3}).logprobs is None


def test_previous_turns_come_first_and_are_not_changed() -> None:
    history = [Message(role="user", content="Weather?"),
               Message(role="assistant", content="", tool_calls=[ToolCall(
                   id="call_0", function=FunctionCall(name="get_weather", arguments={}))])]
    kept = msgspec.json.encode(history)
    request = responses_request(decode({"instructions": "I", "input": [CALL, RESULT]}), "r",
                                history)
    assert [m.role for m in request.request.messages] == ["system", "user", "assistant", "tool"]
    assert request.conversation == request.request.messages[1:]
    calls = request.request.messages[2].tool_calls
    assert calls is not None and [c.id for c in calls] == ["call_0", "call_1"]
    assert msgspec.json.encode(history) == kept  # the stored conversation is shared


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"content": "x"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{**CALL, "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{**CALL, "name": "no spaces"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": ""}, "input"),
    ({"input": "hi", "stop": ["a"] * 9}, "stop"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "hi", "conversation": {"id": "conv"}}, "conversation"),
    ({"input": "hi", "background": True, "stream": True}, "stream"),
    ({"input": "hi", "background": True, "store": False}, "store"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        mapped(body)
    check_refusal(caught.value)
    assert caught.value.param == param


def test_a_wrong_type_names_the_field() -> None:
    for body, param in [({"input": 5}, "input"), ({"max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": [{"role": 1}]}, "input[0].role"),
                        ({"tools": [{"type": "function", "parameters": []}]},
                         "tools[0].parameters"),
                        ({"text": {"format": {"type": "xml"}}}, "text.format.type")]:
        with pytest.raises(msgspec.ValidationError) as caught:
            decode(body)
        assert ApiError.invalid(str(caught.value)).param == param


# --- replies ---------------------------------------------------------------------------


def done(text: str, calls: list[ToolCall] | None = None, finish: str = "stop") -> Result:
    return Result(
        id="x", text=text, finish_reason=finish, stop_sequence=None,  # type: ignore[arg-type]
        truncated=False, tool_calls=calls,
        usage=Usage(prompt_tokens=7, cached_tokens=3, completion_tokens=5, drafted_tokens=0,
                    accepted_tokens=0),
        timings=Timings(queued_ms=0, prompt_ms=0, prompt_tok_s=0, first_token_ms=0,
                        decode_ms=0, decode_tok_s=0, total_ms=0, cache_source="none"))


def events(data: bytes) -> list[dict[str, Any]]:
    found = []
    for block in data.decode().split("\n\n"):
        if block:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == "event: " + event["type"]
            found.append(event)
    return found


@given(st.lists(st.text(min_size=1, max_size=5), max_size=5), st.integers(0, 3),
       st.sampled_from(["stop", "length", "tool_calls"]))
def test_streamed_events_are_numbered_in_the_documented_order(
        pieces: list[str], n_calls: int, finish: str) -> None:
    kept: list[tuple[str, int]] = []
    shape = ResponsesShape("m", decode({"input": "hi"}),
                           lambda body, conversation, own: kept.append((body.id, own)))
    shape.conversation = [Message(role="user", content="hi")]
    shape.history_length = 0
    pending = bytearray()
    for piece in pieces:
        shape.chunk(piece, None, pending)
    calls = [ToolCall(id=f"call_{n}", function=FunctionCall(name="f", arguments={"n": n}))
             for n in range(n_calls)]
    closing = shape.closing(done("", calls or None, finish))
    stream = events(shape.opening() + bytes(pending) + closing)
    assert [event["sequence_number"] for event in stream] == list(range(len(stream)))
    kinds = [event["type"] for event in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    message = ["response.output_item.added", "response.content_part.added",
               *["response.output_text.delta"] * len(pieces), "response.output_text.done",
               "response.content_part.done", "response.output_item.done"] if pieces else []
    call = ["response.output_item.added", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done"]
    # A call is a whole answer even at the budget (its document was closed to fit).
    last = "response.incomplete" if finish == "length" and not calls else "response.completed"
    assert kinds[2:] == [*message, *call * n_calls, last]
    final = stream[-1]["response"]
    assert [item["type"] for item in final["output"]] == \
        ["message"] * bool(pieces) + ["function_call"] * n_calls
    if pieces:
        assert final["output"][0]["content"][0]["text"] == "".join(pieces)
    assert [json.loads(item["arguments"]) for item in final["output"][bool(pieces):]] == \
        [{"n": n} for n in range(n_calls)]
    # Kept before the client could read its id, with its own messages: the input's and
    # the answer.
    assert kept == [(final["id"], 2)]


def test_a_failure_ends_the_stream_with_response_failed() -> None:
    shape = ResponsesShape("m", decode({"input": "hi"}), None)
    stream = events(shape.opening() + shape.failure(ApiError(500, "boom", None, "internal")))
    assert [event["type"] for event in stream] == ["response.created", "response.in_progress",
                                                   "error", "response.failed"]
    assert stream[-1]["response"]["status"] == "failed"
    assert stream[-1]["response"]["error"] == {"code": "internal", "message": "boom"}
