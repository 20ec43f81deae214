"""The OpenAI mapping's pure logic (openai/schema.py, openai/translate.py), fast:
whatever a client sends is decoded and mapped or refused with a 400, never a crash;
what is valid maps field for field onto the request an NDJSON client would send."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core import errors
from sfcore_daemon.core.request import ChatRequest, GenerateRequest
from sfcore_daemon.core.result import Result, Timings, TokenLogprob, TopLogprob, Usage
from sfcore_daemon.openai import schema, translate
from sfcore_daemon.openai.translate import ApiError
from tests.kit.mapping import FAST, as_ndjson, check_refusal, json_values

CHAT_FIELDS = ["model", "messages", "stream", "stream_options", "max_tokens",
               "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n",
               "frequency_penalty", "presence_penalty", "logit_bias", "response_format",
               "top_k", "min_p", "repeat_penalty", "logprobs", "top_logprobs", "tools",
               "functions", "user", "service_tier"]
COMPLETION_FIELDS = [*[f for f in CHAT_FIELDS if f not in ("messages", "top_logprobs")],
                     "prompt", "echo", "suffix", "best_of"]

# Likely-looking values for the fields, so decoding gets past the top level often.
near_values = json_values | st.sampled_from([
    [], [{"role": "user", "content": "hi"}], [{"role": "developer", "content": None}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
    [{"role": "tool", "content": "x"}], [{"role": "assistant", "tool_calls": [{}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": False}},
    {"type": "json_schema", "json_schema": {"schema": True}}, {"type": "json_object"},
    {"type": "text"}, {"include_usage": True}, ["a"] * 9, ["", ""], "", "x", ["x"], [[1]],
    [1, 2], 0, 1, 2, 20, 21, -1, 2**31, 2**64, 0.0, 2.5, True, False,
])


def bodies(fields: list[str], base: st.SearchStrategy[dict[str, Any]] | None = None,
           ) -> st.SearchStrategy[dict[str, Any]]:
    """Arbitrary bodies; with `base`, a valid body with a few fields made arbitrary (so
    most examples get past decoding and reach the mapping's own checks)."""
    changes = st.dictionaries(st.sampled_from(fields) | st.text(max_size=6), near_values,
                              max_size=8 if base is None else 3)
    if base is None:
        return changes
    return st.tuples(base, changes).map(lambda pair: {**pair[0], **pair[1]})


def map_chat(data: bytes) -> ChatRequest | None:
    try:
        request = translate.chat_request(schema.chat_decoder.decode(data), "id")
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except ApiError as error:
        check_refusal(error)
        return None
    as_ndjson(request)
    return request


def map_completion(data: bytes) -> GenerateRequest | None:
    try:
        request = translate.completion_request(schema.completion_decoder.decode(data), "id")
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except ApiError as error:
        check_refusal(error)
        return None
    as_ndjson(request)
    return request


# --- anything a client sends -------------------------------------------------------------


@FAST
@given(bodies(CHAT_FIELDS) | bodies(CHAT_FIELDS, st.deferred(lambda: chat_bodies)))
def test_any_chat_body_is_mapped_or_refused_with_a_400(body: dict[str, Any]) -> None:
    map_chat(msgspec.json.encode(body))


@FAST
@given(bodies(COMPLETION_FIELDS)
       | bodies(COMPLETION_FIELDS, st.deferred(lambda: completion_bodies)))
def test_any_completions_body_is_mapped_or_refused_with_a_400(body: dict[str, Any]) -> None:
    map_completion(msgspec.json.encode(body))


@FAST
@given(st.binary(max_size=64) | json_values.map(msgspec.json.encode))
def test_any_bytes_are_mapped_or_refused(data: bytes) -> None:
    map_chat(data)
    map_completion(data)


def test_a_decoding_error_names_the_field_as_param() -> None:
    for body, param in [({"messages": [], "temperature": 5}, "temperature"),
                        ({"messages": [{"role": 1}]}, "messages[0].role"),
                        ({"messages": [], "top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(msgspec.ValidationError) as caught:
            schema.chat_decoder.decode(msgspec.json.encode(body))
        error = ApiError.invalid(str(caught.value))
        assert (error.status, error.param) == (400, param)


# --- what valid bodies map to ------------------------------------------------------------

texts = st.text(max_size=10)
parts = st.lists(texts, min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": texts | st.none() | parts.map(
        lambda ts: [{"type": "text", "text": t} for t in ts]),
}), min_size=1, max_size=4)
response_formats = st.sampled_from([
    None, {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"schema": True}},
])
sampling = {
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 2**31 - 1),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 2**31 - 1),
    "min_p": st.floats(0, 1),
    "repeat_penalty": st.floats(0, 1e6, exclude_min=True),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.none() | texts | st.lists(texts, max_size=8),
    "n": st.sampled_from([None, 1]),
    "response_format": response_formats,
    # Any value is taken, as before it meant anything; only "flex" asks for background.
    "service_tier": st.sampled_from([None, "auto", "default", "flex", "priority", "Flex"])
    | json_values,
}
chat_bodies: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"messages": messages},
    optional={**sampling, "max_completion_tokens": st.integers(1, 2**31 - 1),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20),
              "user": texts})
completion_bodies: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=10) | st.text(min_size=1).map(lambda t: [t])},
    optional={**sampling, "logprobs": st.none() | st.integers(0, 20),
              "echo": st.just(False), "best_of": st.sampled_from([None, 1])})


def check_sampling(body: dict[str, Any], mapped: ChatRequest | GenerateRequest) -> None:
    for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                 "frequency_penalty", "presence_penalty"):
        assert getattr(mapped, name) == body.get(name), name
    assert mapped.stream == body.get("stream", False)
    seed = body.get("seed")
    assert mapped.seed == (None if seed is None else seed % (1 << 63))
    stop = body.get("stop")
    stops = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
    assert mapped.stop == (stops or None)
    response_format = body.get("response_format") or {"type": "text"}
    if response_format["type"] == "json_object":
        assert (mapped.format, mapped.json_schema) == ("json", None)
    elif response_format["type"] == "json_schema":
        schema_given = response_format["json_schema"]["schema"]
        assert mapped.format is None
        assert mapped.json_schema == ({} if schema_given is True else schema_given)
    else:
        assert (mapped.format, mapped.json_schema) == (None, None)
    flex = body.get("service_tier") == "flex"
    assert mapped.priority == ("background" if flex else "interactive")


@FAST
@given(chat_bodies)
def test_a_valid_chat_body_maps_field_for_field(body: dict[str, Any]) -> None:
    data = msgspec.json.encode(body)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        with pytest.raises(ApiError) as caught:
            translate.chat_request(schema.chat_decoder.decode(data), "id")
        assert caught.value.param == "top_logprobs"
        return
    mapped = map_chat(data)
    assert mapped is not None
    assert mapped.id == "id"
    check_sampling(body, mapped)
    expected_max = body.get("max_completion_tokens", body.get("max_tokens"))
    assert mapped.max_tokens == expected_max
    assert mapped.logprobs == ((body.get("top_logprobs") or 0) if body.get("logprobs")
                               else None)
    assert len(mapped.messages) == len(body["messages"])
    for given_message, message in zip(body["messages"], mapped.messages, strict=True):
        role = given_message["role"]
        assert message.role == ("system" if role == "developer" else role)
        content = given_message["content"]
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        assert message.content == (content or "")


@FAST
@given(completion_bodies)
def test_a_valid_completions_body_maps_field_for_field(body: dict[str, Any]) -> None:
    mapped = map_completion(msgspec.json.encode(body))
    assert mapped is not None
    prompt = body["prompt"]
    assert mapped.prompt == (prompt[0] if isinstance(prompt, list) else prompt)
    check_sampling(body, mapped)
    assert mapped.max_tokens == body.get("max_tokens")
    assert mapped.logprobs == body.get("logprobs")


def test_examples_of_the_mapping() -> None:
    chat = translate.chat_request(schema.chat_decoder.decode(msgspec.json.encode({
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4,
        "response_format": {"type": "json_object"}, "stop": "\n"})), "c")
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"),
                                                             ("user", "a\nb")]
    assert (chat.max_tokens, chat.logprobs, chat.format, chat.stop) == (9, 4, "json", ["\n"])
    refused: list[tuple[dict[str, Any], str]] = [
        ({"n": 2}, "n"), ({"logit_bias": {"1": 1}}, "logit_bias"),
        ({"functions": [{}]}, "functions"),
        ({"stop": ["x"] * 9}, "stop"), ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema")]
    for body, param in refused:
        decoded = schema.chat_decoder.decode(msgspec.json.encode(
            {"messages": [{"role": "user", "content": "x"}], **body}))
        with pytest.raises(ApiError) as caught:
            translate.chat_request(decoded, "c")
        assert (caught.value.status, caught.value.param) == (400, param)
    refused = [({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
               ({"prompt": [[1, 2]]}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
               ({"prompt": "a", "suffix": "z"}, "suffix"),
               ({"prompt": "a", "best_of": 2}, "best_of")]
    for body, param in refused:
        with pytest.raises(ApiError) as caught:
            translate.completion_request(
                schema.completion_decoder.decode(msgspec.json.encode(body)), "c")
        assert (caught.value.status, caught.value.param) == (400, param)


# --- replies ---------------------------------------------------------------------------------


def done(finish: str, truncated: bool = False) -> Result:
    return Result(
        id="x", text="t", finish_reason=finish, stop_sequence=None,  # type: ignore[arg-type]
        truncated=truncated,
        usage=Usage(prompt_tokens=7, cached_tokens=3, completion_tokens=5, drafted_tokens=0,
                    accepted_tokens=0),
        timings=Timings(queued_ms=0, prompt_ms=0, prompt_tok_s=0, first_token_ms=0,
                        decode_ms=0, decode_tok_s=0, total_ms=0, cache_source="none"))


def test_finish_reasons() -> None:
    assert translate.finish_reason(done("stop")) == "stop"
    assert translate.finish_reason(done("stop_sequence")) == "stop"
    assert translate.finish_reason(done("length")) == "length"
    assert translate.finish_reason(done("cancelled")) == "length"
    assert translate.finish_reason(done("stop", truncated=True)) == "length"


def test_usage() -> None:
    usage = translate.usage(done("stop"))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens,
            usage.prompt_tokens_details.cached_tokens) == (7, 5, 12, 3)


entries = st.lists(st.builds(
    lambda text, value, tops: TokenLogprob(
        token=1, text=text, bytes=list(text.encode()), logprob=value,
        top_logprobs=[TopLogprob(token=i, text=t, bytes=list(t.encode()), logprob=v)
                      for i, (t, v) in enumerate(tops)]),
    st.text(max_size=4), st.floats(-50, 0),
    st.lists(st.tuples(st.text(max_size=3), st.floats(-50, 0)), max_size=3)), max_size=8)


@FAST
@given(entries, st.integers(0, 1000))
def test_legacy_logprobs_offsets_are_cumulative(items: list[TokenLogprob], offset: int) -> None:
    legacy = translate.legacy_logprobs(items, offset)
    assert legacy.tokens == [item.text for item in items]
    assert legacy.token_logprobs == [item.logprob for item in items]
    assert len(legacy.top_logprobs) == len(legacy.text_offset) == len(items)
    position = offset
    for item, found in zip(items, legacy.text_offset, strict=True):
        assert found == position
        position += len(item.text)
    for item, tops in zip(items, legacy.top_logprobs, strict=True):
        assert set(tops) == {top.text for top in item.top_logprobs}
    chat = translate.chat_logprobs(items)
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in chat.content] == \
        [(i.text, i.logprob, len(i.top_logprobs)) for i in items]


def test_daemon_error_codes_as_http_errors() -> None:
    expected = {errors.INVALID_REQUEST: (400, "invalid_request"),
                errors.CONTEXT_OVERFLOW: (400, "context_length_exceeded"),
                errors.QUEUE_FULL: (429, "queue_full"),
                errors.LINE_TOO_LONG: (413, "line_too_long"),
                errors.SHUTTING_DOWN: (503, "shutting_down"),
                errors.INTERNAL: (500, "internal")}
    for code, (status, openai_code) in expected.items():
        error = ApiError.from_code(code, "m")
        assert (error.status, error.code, error.param) == (status, openai_code, None)
    # Every code the daemon has maps to an HTTP error status.
    assert all(ApiError.from_code(code, "m").status >= 400 for code in errors.ERROR_CODES)
    # The daemon's field names, as the OpenAI field they came from.
    schema_error = ApiError.from_code(errors.INVALID_REQUEST,
                                      "bad schema - at `$.json_schema.properties`")
    assert schema_error.param == "response_format"
    assert ApiError.from_code(errors.INVALID_REQUEST, "x - at `$.stop[2]`").param == "stop[2]"
