"""The Messages mapping's pure logic (anthropic/), fast: whatever a client sends
is decoded and mapped, or refused with a 400 naming the field, never a crash; what is
valid maps onto a request the NDJSON decoder takes; the reply's events are what the
`anthropic` SDK's own types parse."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pydantic
import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse as SdkErrorResponse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.anthropic import errors, translate
from sfcore_daemon.anthropic.reply import MessagesShape
from sfcore_daemon.anthropic.schema import count_tokens_decoder, messages_decoder
from sfcore_daemon.core import errors as codes
from sfcore_daemon.core import result
from sfcore_daemon.core.request import ChatRequest, FunctionCall, ToolCall
from sfcore_daemon.core.result import Result, Timings, Usage
from sfcore_daemon.httpd.reply import HttpReply
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.openai.translate import ApiError

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = ["model", "messages", "max_tokens", "system", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "tools", "tool_choice", "output_config",
          "metadata", "thinking"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10)
texts = st.text(max_size=8)
blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", ""]),
                           "name": st.sampled_from(["add", "get_weather", "a b"]),
                           "input": st.sampled_from([{}, {"a": 1}, [1]])}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1")},
                          optional={"content": texts | st.lists(st.fixed_dictionaries(
                              {"type": st.sampled_from(["text", "image"]), "text": texts}),
                              max_size=2),
                              "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document",
                                                    "server_tool_use", "redacted_thinking"])}),
)
turns = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "user", "assistant", "system"]),
    "content": texts | st.lists(blocks, max_size=3)}), min_size=0, max_size=4)
schemas = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}, {"type": "string"}, {"minimum": "x"}])
tools = st.lists(st.fixed_dictionaries(
    {"name": st.sampled_from(["add", "get_weather", "add", "bad name"])},
    optional={"input_schema": schemas, "description": texts,
              "type": st.sampled_from(["custom", "web_search_20250305", "bash_20250124"])}),
    max_size=3)
tool_choices = st.fixed_dictionaries(
    {"type": st.sampled_from(["auto", "any", "tool", "none", "other"])},
    optional={"name": st.sampled_from(["add", "nope"]),
              "disable_parallel_tool_use": st.booleans()})
valid_fields: dict[str, st.SearchStrategy[Any]] = {
    "model": texts,
    "system": texts | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "text", "image"]), "text": texts}), max_size=2),
    "stop_sequences": st.lists(texts, max_size=10),
    "stream": st.booleans(),
    "temperature": st.floats(0, 1) | st.floats(-0.5, 1.5),
    "top_p": st.floats(0, 1) | st.floats(-0.5, 1.5),
    "top_k": st.integers(0, 64) | st.integers(-1, 2**32),
    "tools": tools,
    "tool_choice": tool_choices,
    "output_config": st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
        {"type": st.just("json_schema"), "schema": schemas}), "effort": texts}),
    "thinking": json_values,
}
# Mostly valid bodies with a few fields of their own: most get past decoding and reach
# the mapping's checks.
near_bodies = st.fixed_dictionaries(
    {"messages": turns, "max_tokens": st.integers(1, 64) | st.integers(-1, 2**31)},
    optional=valid_fields)
any_bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6),
                             json_values | turns | tools | tool_choices, max_size=6)


def refused_as_the_route_does(data: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    """The body decoded as the route decodes it; an ApiError (checked: a 400 naming the
    field) when it is refused, else what the route goes on with."""
    try:
        return translate.chat_request(decoder.decode(data), "id")
    except msgspec.ValidationError as exc:
        error = ApiError.invalid(str(exc))
    except msgspec.DecodeError:
        return None  # not JSON: the route's bad_json 400, no field to name
    except ApiError as exc:
        error = exc
    assert error.status == 400
    body = errors.error_body(error)
    assert body.error.type == "invalid_request_error" and body.error.message
    message = body.error.message
    # The field is named: a path, a missing field, or (the whole body) its type.
    assert (error.param is not None and error.param in message) \
        or "missing required field `" in message or message.startswith("Expected `object`"), \
        message
    return error


def re_encodes_as_ndjson(request: ChatRequest) -> None:
    line = msgspec.json.encode({"op": "chat", **msgspec.structs.asdict(request)})
    decoded = msgspec.json.decode(line, type=protocol.Request)
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(request)


@FAST
@given(near_bodies | any_bodies)
def test_any_body_is_a_400_naming_its_field_or_a_valid_ndjson_request(
        body: dict[str, Any]) -> None:
    data = msgspec.json.encode(body)
    for decoder in (messages_decoder, count_tokens_decoder):
        mapped = refused_as_the_route_does(data, decoder)
        if isinstance(mapped, ChatRequest):
            re_encodes_as_ndjson(mapped)


@FAST
@given(st.binary(max_size=64))
def test_any_bytes_are_refused_or_mapped(data: bytes) -> None:
    for decoder in (messages_decoder, count_tokens_decoder):
        mapped = refused_as_the_route_does(data, decoder)
        if isinstance(mapped, ChatRequest):
            re_encodes_as_ndjson(mapped)


def test_examples_of_the_mapping() -> None:
    mapped = translate.chat_request(messages_decoder.decode(json.dumps({
        "model": "claude-x", "max_tokens": 9, "temperature": 0.5, "top_k": 3, "top_p": 0,
        "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        "stop_sequences": ["\n", ""], "stream": True,
        "tools": [{"name": "add", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "x", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]},
                {"type": "text", "text": "thanks"}]}]})), "r")
    assert [(m.role, m.content) for m in mapped.messages] == [
        ("system", "a\nb"), ("user", "hi"), ("assistant", "calling"), ("tool", "2"),
        ("tool", "Error: boom"), ("user", "thanks")]
    assert mapped.messages[2].tool_calls == [
        ToolCall(id="toolu_1", function=FunctionCall(name="add", arguments={"a": 1}))]
    assert [m.tool_call_id for m in mapped.messages[3:5]] == ["toolu_1", "toolu_2"]
    assert (mapped.max_tokens, mapped.temperature, mapped.top_k, mapped.top_p) == (9, 0.5, 1,
                                                                                  None)
    assert (mapped.stop, mapped.stream, mapped.tool_choice, mapped.parallel_tool_calls) == (
        ["\n"], True, "required", False)
    assert mapped.tools is not None and mapped.tools[0].function.parameters == {
        "type": "object"}
    structured = translate.chat_request(messages_decoder.decode(json.dumps({
        "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}},
                          "effort": "low"}})), "r")
    assert structured.json_schema == {"type": "object"}


def test_schema_errors_name_the_messages_fields() -> None:
    for message, param, expected in [
            ("bad - at `$.tools[1].function.parameters.minimum`",
             "tools[1].function.parameters.minimum", "tools[1].input_schema.minimum"),
            ("two tools are named 'a' - at `$.tools[1].function.name`",
             "tools[1].function.name", "tools[1].name"),
            ("bad - at `$.json_schema.type`", "response_format",
             "output_config.format.schema")]:
        error = translate.in_messages_terms(ApiError(400, message, param))
        assert error.param == expected and expected in error.message


def test_error_types_by_status() -> None:
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"),
                         (403, "permission_error"), (404, "not_found_error"),
                         (405, "invalid_request_error"), (408, "timeout_error"),
                         (413, "invalid_request_error"), (429, "rate_limit_error"),
                         (500, "api_error"), (503, "overloaded_error")]:
        body = msgspec.json.encode(errors.error_body(ApiError(status, "why")))
        parsed = SdkErrorResponse.model_validate_json(body)
        assert parsed.error.type == kind and parsed.error.message == "why"
    assert errors.is_messages_path("/v1/messages")
    assert errors.is_messages_path("/v1/messages/count_tokens")
    assert not errors.is_messages_path("/v1/messagesx")


def _done(reason: result.FinishReason, *, stop: str | None = None,
          calls: list[ToolCall] | None = None, text: str = "") -> Result:
    return Result(
        id="r", text=text, finish_reason=reason, stop_sequence=stop, truncated=False,
        usage=Usage(prompt_tokens=7, cached_tokens=0, completion_tokens=3, drafted_tokens=0,
                    accepted_tokens=0),
        timings=Timings(queued_ms=0, prompt_ms=1, prompt_tok_s=1, first_token_ms=1,
                        decode_ms=1, decode_tok_s=1, total_ms=1, cache_source="none"),
        tool_calls=calls)


CALL = ToolCall(id="call_ab", function=FunctionCall(name="add", arguments={"a": 1, "b": 2}))
_events = pydantic.TypeAdapter(RawMessageStreamEvent)


def _stream(texts: list[str], done: Result | ApiError) -> list[tuple[str, Any]]:
    shape = MessagesShape("m")
    shape.input_tokens = 7
    reply = HttpReply(shape, True, 1 << 20, lambda _: None)
    for text in texts:
        reply.token(text, None)
    if isinstance(done, Result):
        reply.done(done)
    else:
        reply.error(codes.INTERNAL, done.message)
    stream = (shape.opening() + reply.take()).decode()
    pairs = []
    for block in stream.strip().split("\n\n"):
        kind_line, data_line = block.split("\n")
        pairs.append((kind_line.removeprefix("event: "), json.loads(data_line[6:])))
    return pairs


@pytest.mark.parametrize(("texts", "done", "reason", "blocks"), [
    (["Hel", "lo"], _done("stop"), "end_turn", ["text"]),
    ([], _done("length"), "max_tokens", ["text"]),
    (["a"], _done("stop_sequence", stop="b"), "stop_sequence", ["text"]),
    (["I'll add."], _done("tool_calls", calls=[CALL, CALL]), "tool_use",
     ["text", "tool_use", "tool_use"]),
    ([], _done("tool_calls", calls=[CALL]), "tool_use", ["tool_use"]),
])
def test_stream_events_are_what_the_sdk_parses_and_equal_the_whole_body(
        texts: list[str], done: Result, reason: str, blocks: list[str]) -> None:
    events = _stream(texts, done)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                     "message_stop"]
    snapshot: dict[str, Any] = {}
    for kind, data in events:
        if kind != "ping":
            assert _events.validate_python(data).type == kind
        if kind == "message_start":
            snapshot = data["message"]
        elif kind == "content_block_start":
            assert data["index"] == len(snapshot["content"])
            snapshot["content"].append(data["content_block"])
        elif kind == "content_block_delta":
            block, delta = snapshot["content"][data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["input"] = json.loads(delta["partial_json"])
        elif kind == "message_delta":
            snapshot.update(data["delta"])
            snapshot["usage"] = data["usage"]
    assert [block["type"] for block in snapshot["content"]] == blocks
    assert snapshot["stop_reason"] == reason
    whole_done = msgspec.structs.replace(done, text="".join(texts))
    whole = json.loads(MessagesShape("m").whole(whole_done))
    SdkMessage.model_validate(whole)
    for block in (*whole["content"], *snapshot["content"]):
        block.pop("id", None)
    whole.pop("id")
    snapshot.pop("id")
    assert snapshot == whole


def test_a_failure_mid_stream_is_an_error_event() -> None:
    events = _stream(["a"], ApiError(500, "it broke"))
    kind, data = events[-1]
    assert kind == "error"
    assert SdkErrorResponse.model_validate(data).error.type == "api_error"
    assert "it broke" in data["error"]["message"]
