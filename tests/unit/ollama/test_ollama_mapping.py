"""The Ollama mapping's pure logic (ollama/schema.py, ollama/translate.py), fast:
whatever a client sends to /api/chat or /api/generate is decoded and mapped or refused
with a 400, never a crash; what maps is a request the NDJSON side would accept."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.core.request import ChatRequest, GenerateRequest
from sfcore_daemon.core.result import Result, Timings, Usage
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ollama import reply, schema, translate

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

COMMON = ["model", "stream", "format", "options", "keep_alive", "think", "logprobs",
          "top_logprobs"]
CHAT_FIELDS = [*COMMON, "messages", "tools"]
GENERATE_FIELDS = [*COMMON, "prompt", "system", "raw", "suffix", "template", "images",
                   "context"]
OPTION_FIELDS = ["num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "num_ctx",
                 "mirostat", "num_thread"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
options = st.dictionaries(st.sampled_from(OPTION_FIELDS), json_values | st.sampled_from(
    [0, 1, -1, -2, 0.0, 0.5, 1.0, 2.5, 2**31, 2**63, ["a"] * 9, ["", "x"], "x"]), max_size=4)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(
    ["system", "user", "assistant", "tool", "developer"])}, optional={
    "content": st.text(max_size=8) | st.none(),
    "images": st.sampled_from([[], ["aGk="]]),
    "tool_name": st.sampled_from(["add", "x"]),
    "tool_calls": st.lists(st.fixed_dictionaries({"function": st.fixed_dictionaries(
        {"name": st.sampled_from(["add", "bad name", ""])},
        optional={"arguments": st.sampled_from([{}, {"a": 1}, "{\"a\": 1}", "[1]", "x"])})}),
        max_size=2)}), max_size=4)
tools = st.lists(st.fixed_dictionaries(
    {"function": st.fixed_dictionaries({"name": st.sampled_from(["add", "add", "f.g"])},
                                       optional={"parameters": st.sampled_from(
                                           [{"type": "object"}, {"type": "nope"}])})},
    optional={"type": st.sampled_from(["function", "web"])}), max_size=3)
near_values = json_values | options | messages | tools | st.sampled_from(
    ["json", "", "xml", {"type": "object"}, "m", "m:latest", True, False, 0, 20, 21, -1])


def bodies(fields: list[str], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with a few fields made arbitrary, or arbitrary fields alone."""
    changes = st.dictionaries(st.sampled_from(fields) | st.text(max_size=6), near_values,
                              max_size=5)
    return changes | changes.map(lambda change: {**base, **change})


def as_ndjson(request: ChatRequest | GenerateRequest) -> None:
    """What the HTTP side builds must be a request the NDJSON side would accept."""
    op = "chat" if isinstance(request, ChatRequest) else "generate"
    line = msgspec.json.encode({"op": op, **msgspec.structs.asdict(request)})
    msgspec.json.decode(line, type=protocol.Request)


def mapped(data: bytes, chat: bool) -> ChatRequest | GenerateRequest | None:
    """The body mapped, or None when it was refused as the route refuses it: a decoding
    error (host.decode's 400) or an ApiError 400."""
    try:
        if chat:
            request: ChatRequest | GenerateRequest = translate.chat_request(
                schema.chat_decoder.decode(data), "id")
        else:
            request = translate.generate_request(schema.generate_decoder.decode(data), "id")
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except ApiError as error:
        assert error.status == 400 and error.message, error
        return None
    as_ndjson(request)
    return request


@FAST
@given(bodies(CHAT_FIELDS, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
def test_any_chat_body_is_mapped_or_refused_with_a_400(body: dict[str, Any]) -> None:
    mapped(msgspec.json.encode(body), chat=True)


@FAST
@given(bodies(GENERATE_FIELDS, {"model": "m", "prompt": "hi"}))
def test_any_generate_body_is_mapped_or_refused_with_a_400(body: dict[str, Any]) -> None:
    mapped(msgspec.json.encode(body), chat=False)


def test_options_map_onto_the_core_fields() -> None:
    request = mapped(msgspec.json.encode({
        "model": "llama3", "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "format": {"type": "object"}, "keep_alive": "5m", "think": False,
        "options": {"num_predict": 7, "temperature": 0, "top_k": 3, "top_p": 0.5,
                    "min_p": 0.1, "seed": 42, "stop": ["\n"], "repeat_penalty": 1.1,
                    "presence_penalty": 0.5, "frequency_penalty": 0.25,
                    "num_ctx": 8192, "mirostat": 2, "num_thread": 4}}), chat=True)
    assert isinstance(request, ChatRequest)
    assert (request.stream, request.max_tokens, request.temperature, request.top_k,
            request.top_p, request.min_p, request.seed, request.stop, request.repeat_penalty,
            request.presence_penalty, request.frequency_penalty, request.json_schema) == (
        False, 7, 0, 3, 0.5, 0.1, 42, ["\n"], 1.1, 0.5, 0.25, {"type": "object"})
    # Ollama's "no limit", "random seed", "no top-k" and greedy top_p.
    request = mapped(msgspec.json.encode({
        "model": "m", "prompt": "p", "raw": True, "format": "json",
        "options": {"num_predict": -1, "seed": -1, "top_k": -1, "top_p": 0}}), chat=False)
    assert isinstance(request, GenerateRequest)
    assert (request.max_tokens, request.seed, request.top_k, request.top_p, request.format,
            request.stream) == (None, None, 1, None, "json", True)


def test_generate_is_a_chat_of_system_and_prompt_unless_raw() -> None:
    request = mapped(b'{"model": "m", "prompt": "p", "system": "s"}', chat=False)
    assert isinstance(request, ChatRequest)
    assert [(m.role, m.content) for m in request.messages] == [("system", "s"), ("user", "p")]


def test_calls_and_results_keep_their_pairing() -> None:
    request = mapped(msgspec.json.encode({"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "tool_calls": [
            {"function": {"name": "a", "arguments": {"x": 1}}},
            {"function": {"name": "b", "arguments": "{\"y\": 2}"}}]},
        {"role": "tool", "tool_name": "b", "content": "2"},
        {"role": "tool", "content": "1"}],
        "tools": [{"type": "function", "function": {"name": "a"}}]}), chat=True)
    assert isinstance(request, ChatRequest)
    calls = request.messages[1].tool_calls
    assert calls is not None and [c.function.arguments for c in calls] == [{"x": 1}, {"y": 2}]
    assert [m.tool_call_id for m in request.messages[2:]] == [calls[1].id, calls[0].id]


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
     "messages[0].images"),
    ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": "m", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
    ({"model": "m", "prompt": "x", "raw": True, "system": "s"}, "system"),
    ({"model": "", "prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "format": "xml"}, "format"),
])
def test_what_cannot_be_honoured_is_refused_by_name(body: dict[str, Any], field: str) -> None:
    data = msgspec.json.encode(body)
    with pytest.raises(ApiError) as refused:
        if "messages" in body:
            translate.chat_request(schema.chat_decoder.decode(data), "id")
        else:
            translate.generate_request(schema.generate_decoder.decode(data), "id")
    assert refused.value.status == 400 and refused.value.param == field


def test_the_last_line_carries_the_counts_in_nanoseconds() -> None:
    done = Result(id="x", text="hi", finish_reason="length", stop_sequence=None,
                  truncated=False,
                  usage=Usage(prompt_tokens=5, cached_tokens=0, completion_tokens=2,
                              drafted_tokens=0, accepted_tokens=0),
                  timings=Timings(queued_ms=0.5, prompt_ms=1.5, prompt_tok_s=1.0,
                                  first_token_ms=2.0, decode_ms=3.25, decode_tok_s=1.0,
                                  total_ms=5.0, cache_source="none"))
    last = msgspec.json.decode(reply.GenerateShape("m:latest").closing(done))
    assert last["done"] is True and last["done_reason"] == "length" and last["response"] == ""
    assert (last["prompt_eval_count"], last["eval_count"], last["total_duration"],
            last["prompt_eval_duration"], last["eval_duration"]) == (
        5, 2, 5_000_000, 1_500_000, 3_250_000)
    whole = msgspec.json.decode(reply.ChatShape("m:latest").whole(done))
    assert whole["message"] == {"role": "assistant", "content": "hi"}


def test_a_failure_once_streaming_is_an_error_line() -> None:
    error = ApiError(500, "the model failed")
    for shape in (reply.ChatShape("m"), reply.GenerateShape("m")):
        assert shape.failure(error) == b'{"error":"the model failed"}\n'
        assert shape.content_type == "application/x-ndjson" and shape.opening() == b""
