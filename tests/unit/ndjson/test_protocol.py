"""Unit tests of request decoding and error classification (no model)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core import errors
from sfcore_daemon.core.request import ChatRequest, GenerateRequest
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ndjson.protocol import HealthRequest, QueuedReply, RequestError
from tests.kit.mapping import FAST, json_values


def decode_error(line: bytes) -> RequestError:
    with pytest.raises(RequestError) as caught:
        protocol.decode_request(line)
    return caught.value


def test_minimal_generate_request_decodes_with_defaults() -> None:
    request = protocol.decode_request(
        b'{"prompt": "Jelaskan Rust dalam 1 kalimat", "stream": true, "max_tokens": 100}')
    assert isinstance(request, GenerateRequest)
    assert request.prompt == "Jelaskan Rust dalam 1 kalimat"
    assert request.max_tokens == 100
    assert request.cache_prompt is True
    assert request.temperature is None  # filled from [generation] by the server
    assert isinstance(request.id, str) and request.id.startswith("sfc-")


def test_assigned_ids_are_unique() -> None:
    ids = {protocol.decode_request(b'{"op": "health"}').id for _ in range(100)}
    assert len(ids) == 100


@pytest.mark.parametrize("request_id", ["abc", 7, 0, -3])
def test_client_id_is_kept(request_id: object) -> None:
    request = protocol.decode_request(json.dumps({"op": "health", "id": request_id}).encode())
    assert isinstance(request, HealthRequest)
    assert request.id == request_id


@pytest.mark.parametrize(
    "line",
    [
        b'{"prompt": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "temperature": 1e999}',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "\\udc00 tail"}',
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "x"',
        b'{"prompt": "x"} trailing',
        b"[1, 2]",
        b'"just a string"',
        b"42",
    ],
)
def test_bad_json(line: bytes) -> None:
    assert decode_error(line).code == errors.BAD_JSON


@pytest.mark.parametrize(
    ("line", "field"),
    [
        (b'{"prompt": "hi", "max_tokens": 0}', "$.max_tokens"),
        (b'{"prompt": "hi", "max_tokens": "10"}', "$.max_tokens"),
        (b'{"prompt": "hi", "temperature": -1}', "$.temperature"),
        (b'{"prompt": "hi", "top_p": 0}', "$.top_p"),
        (b'{"prompt": "hi", "min_p": 1.5}', "$.min_p"),
        (b'{"prompt": "hi", "repeat_penalty": 0}', "$.repeat_penalty"),
        (b'{"prompt": "hi", "top_k": -1}', "$.top_k"),
        (b'{"prompt": "hi", "seed": -1}', "$.seed"),
        (b'{"prompt": "hi", "stop": [""]}', "$.stop[0]"),
        (b'{"prompt": "hi", "stop": ["1","2","3","4","5","6","7","8","9"]}', "$.stop"),
        (b'{"prompt": ""}', "$.prompt"),
        (b'{"prompt": 5}', "$.prompt"),
        (b'{"prompt": "hi", "stream": "yes"}', "$.stream"),
        (b'{"prompt": "hi", "id": 1.5}', "$.id"),
        (b'{"prompt": "hi", "id": true}', "$.id"),
        (b'{"op": "nope"}', "$.op"),
    ],
)
def test_invalid_request_names_the_field(line: bytes, field: str) -> None:
    error = decode_error(line)
    assert error.code == errors.INVALID_REQUEST
    assert f"`{field}`" in error.message


@pytest.mark.parametrize(
    ("line", "word"),
    [
        (b'{"prompt": "hi", "tempreature": 0.5}', "tempreature"),
        (b'{"op": "health", "prompt": "x"}', "prompt"),
        (b"{}", "prompt"),
    ],
)
def test_unknown_and_missing_fields_are_named(line: bytes, word: str) -> None:
    error = decode_error(line)
    assert error.code == errors.INVALID_REQUEST
    assert word in error.message


def test_error_keeps_the_client_id_when_it_can_be_read() -> None:
    assert decode_error(b'{"id": "q1", "prompt": "hi", "max_tokens": -5}').request_id == "q1"
    assert decode_error(b'{"id": 12, "op": "nope"}').request_id == 12
    assert decode_error(b'{"id": "q1", "prompt": NaN}').request_id is None


def test_unknown_op_lists_the_known_ones() -> None:
    message = decode_error(b'{"op": "chatt"}').message
    assert "'chatt'" in message and "generate" in message and "health" in message


def test_stop_forms() -> None:
    single = protocol.decode_request(b'{"prompt": "x", "stop": "END"}')
    several = protocol.decode_request(b'{"prompt": "x", "stop": ["a", "b", "a"]}')
    assert isinstance(single, GenerateRequest) and isinstance(several, GenerateRequest)
    assert single.stop_sequences == ("END",)
    assert several.stop_sequences == ("a", "b")


@FAST
@given(st.sampled_from(["interactive", "background", "Background", "urgent", ""])
       | json_values, st.sampled_from(["generate", "chat"]))
def test_priority_is_one_of_the_two_classes_or_an_invalid_request_naming_it(
        value: object, op: str) -> None:
    body: dict[str, object] = {"op": op, "id": "p", "priority": value}
    body.update({"prompt": "x"} if op == "generate" else
                {"messages": [{"role": "user", "content": "x"}]})
    line = json.dumps(body).encode()
    if value in ("interactive", "background"):
        request = protocol.decode_request(line)
        assert isinstance(request, GenerateRequest | ChatRequest)
        assert request.priority == value
    else:
        error = decode_error(line)
        assert (error.code, error.request_id) == (errors.INVALID_REQUEST, "p")
        assert "`$.priority`" in error.message, error.message


def test_priority_defaults_to_interactive() -> None:
    request = protocol.decode_request(b'{"prompt": "x"}')
    assert isinstance(request, GenerateRequest) and request.priority == "interactive"


def test_the_queued_line() -> None:
    line = protocol.encode_line(QueuedReply(id="q", position=2, queue_depth=5))
    assert json.loads(line) == {"type": "queued", "id": "q", "position": 2, "queue_depth": 5}


def test_reply_lines_are_single_line_json() -> None:
    line = protocol.error_line("x", errors.INTERNAL, "multi\nline")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {"type": "error", "id": "x", "code": "internal",
                                "message": "multi\nline"}
