"""The OpenAI-compatible HTTP endpoint, end to end: the real daemon, the real `openai`
SDK (and raw HTTP where the SDK would hide what is checked).

Few daemons are started: one on a TCP port for the API's shapes (reproducible mode,
so that two runs of one greedy request give the same bytes however they are
batched), and one on a Unix socket with an API key, one slot and no queue for the
refusals. Each is shared by its tests (module scope, one event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import openai
import pytest
import pytest_asyncio

from tests.kit import done_of, run_cli, tokens_text
from tests.kit.http import (
    KEY,
    MODEL_ID,
    PERSON,
    WAIT_S,
    Endpoint,
    endpoint,
    module_test,
    raises,
)

MESSAGES: list[Any] = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROMPT = "The three primary colors are"
# A greedy reply that runs long: the model does not stop within 400 tokens (checked).
COUNTING: list[Any] = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp() -> AsyncIterator[Endpoint]:
    config = {"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 4},
              "model": {"reproducible": True}}
    async with endpoint(config) as found:
        assert found.url.startswith("http://127.0.0.1:"), found.url
        yield found


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded() -> AsyncIterator[Endpoint]:
    directory = tempfile.mkdtemp(prefix="sfo", dir="/tmp")  # sun_path holds 108 bytes
    path = f"{directory}/o.sock"
    config = {"openai": {"listen": f"unix:{path}", "api_key": KEY},
              "server": {"slots": 1, "max_queue": 0, "max_line_bytes": 1024}}
    try:
        async with endpoint(config) as found:
            assert found.url == f"unix:{path}", found.url
            yield found
        assert not Path(path).exists(), "the HTTP socket file was left behind"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --- the API's shapes (TCP, no key) ----------------------------------------------------


@module_test
async def test_chat_streamed_deltas_are_the_whole_reply(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 24,
                               "temperature": 0, "seed": 7}
    async with tcp.sdk() as client:
        whole = await client.chat.completions.create(**options)
        assert whole.object == "chat.completion" and whole.model == MODEL_ID
        assert whole.id.startswith("chatcmpl-")
        choice = whole.choices[0]
        assert choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
        stream = await client.chat.completions.create(**options, stream=True)
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == choice.message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks][-1] == choice.finish_reason
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert all(chunk.usage is None for chunk in chunks)  # not asked for


@module_test
async def test_completions_streamed_text_is_the_whole_text(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 24,
                               "temperature": 0, "seed": 7}
    async with tcp.sdk() as client:
        whole = await client.completions.create(**options)
        assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
        choice = whole.choices[0]
        assert choice.text and choice.finish_reason in ("stop", "length")
        stream = await client.completions.create(**options, stream=True)
        chunks = [chunk async for chunk in stream]
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


@module_test
async def test_response_format_json_schema_and_json_object(tcp: Endpoint) -> None:
    async with tcp.sdk() as client:
        reply = await client.chat.completions.create(
            model=MODEL_ID, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON,
                                             "strict": True}})
        content = reply.choices[0].message.content
        assert content is not None
        jsonschema.validate(json.loads(content), PERSON)
        reply = await client.chat.completions.create(
            model=MODEL_ID, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
            response_format={"type": "json_object"})
        content = reply.choices[0].message.content
        assert content is not None
        assert isinstance(json.loads(content), dict), content
        # Completions take it too.
        completion = await client.completions.create(
            model=MODEL_ID, prompt="A person as JSON:", max_tokens=64, temperature=0,
            extra_body={"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "p", "schema": PERSON}}})
        jsonschema.validate(json.loads(completion.choices[0].text), PERSON)


@module_test
async def test_chat_logprobs_name_each_token_and_its_top_alternatives(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"model": MODEL_ID, "messages": MESSAGES, "max_tokens": 12,
                               "temperature": 0, "logprobs": True, "top_logprobs": 3}
    async with tcp.sdk() as client:
        whole = await client.chat.completions.create(**options)
        stream = await client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert whole.usage is not None and len(entries) == whole.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert all(top.logprob <= 0 for top in entry.top_logprobs)
        # Greedy: the chosen token is the likeliest.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob
        assert entry.bytes is not None and entry.token == bytes(entry.bytes).decode(
            "utf-8", "replace")
    joined = b"".join(bytes(entry.bytes or ()) for entry in entries)
    assert joined.decode() == choice.message.content
    # Streamed: the same entries, spread over the chunks.
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content or ()]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


@module_test
async def test_completions_logprobs_in_the_legacy_shape(tcp: Endpoint) -> None:
    async with tcp.sdk() as client:
        reply = await client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=12,
                                                temperature=0, logprobs=2)
    choice = reply.choices[0]
    legacy = choice.logprobs
    assert legacy is not None
    tokens, values = legacy.tokens or [], legacy.token_logprobs or []
    tops, offsets = legacy.top_logprobs or [], legacy.text_offset or []
    assert reply.usage is not None
    assert len(tokens) == len(values) == len(tops) == len(offsets) \
        == reply.usage.completion_tokens > 0
    assert all(value <= 0 for value in values)
    for token, value, top in zip(tokens, values, tops, strict=True):
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert top.get(token) == value  # greedy: the chosen token is among the top
    assert offsets[0] == 0
    for index in range(1, len(offsets)):
        assert offsets[index] == offsets[index - 1] + len(tokens[index - 1])
    assert "".join(tokens) == choice.text


@module_test
async def test_usage_counts_whole_and_streamed(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"model": MODEL_ID, "messages": COUNTING, "max_tokens": 5,
                               "temperature": 0}
    async with tcp.sdk() as client:
        whole = await client.chat.completions.create(**options)
        stream = await client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        completion = await client.completions.create(model=MODEL_ID, prompt=PROMPT,
                                                     max_tokens=3, temperature=0)
    usage = whole.usage
    assert usage is not None and whole.choices[0].finish_reason == "length"
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) \
        == (usage.prompt_tokens, 5, usage.total_tokens)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert completion.choices[0].finish_reason == "length"


@module_test
async def test_a_client_that_hangs_up_mid_stream_cancels_its_generation(tcp: Endpoint) -> None:
    before = (await tcp.stats())["requests"]["by_outcome"]["cancelled"]
    host, port = tcp.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL_ID, "messages": COUNTING, "max_tokens": 400,
                       "temperature": 0, "stream": True}).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), WAIT_S)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"text/event-stream" in head
        first = await asyncio.wait_for(reader.readuntil(b"\n\n"), WAIT_S)
        assert b"data: " in first, first
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), WAIT_S)
    # Counted when abandoned; its slot is freed at the decode thread's next step.
    await tcp.wait_stats(lambda s: s["requests"]["by_outcome"]["cancelled"] == before + 1
                         and not any(slot["busy"] for slot in s["slots"]))
    # The daemon serves on.
    async with tcp.http() as http:
        assert (await http.get("/health")).json()["status"] == "ok"


@module_test
async def test_bad_values_are_400_naming_the_field(tcp: Endpoint) -> None:
    async with tcp.sdk() as client:
        chat = client.chat.completions.create
        cases: list[tuple[dict[str, Any], str]] = [
            ({"messages": MESSAGES, "n": 2}, "n"),
            ({"messages": MESSAGES, "temperature": 5}, "temperature"),
            ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
             "messages[0].content[0].type"),
        ]
        for options, param in cases:
            error = await raises(chat(model=MODEL_ID, max_tokens=4, **options),
                                 openai.BadRequestError)
            assert error.status_code == 400
            assert error.param == param, (options, error.body)
            assert isinstance(error.body, dict)
            assert set(error.body) == {"message", "type", "param", "code"}
            assert error.body["type"] == "invalid_request_error" and error.body["message"]
        error = await raises(client.completions.create(model=MODEL_ID, prompt=PROMPT, n=2),
                             openai.BadRequestError)
        assert error.param == "n"
        # Refused by the daemon's own checks, past the mapping: still 400s in this shape.
        error = await raises(chat(
            model=MODEL_ID, messages=MESSAGES, max_tokens=4,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "wizard"}}}),
            openai.BadRequestError)
        assert error.param == "response_format", error.body
        error = await raises(client.completions.create(
            model=MODEL_ID, prompt="word " * 5000, max_tokens=4), openai.BadRequestError)
        assert error.code == "context_length_exceeded", error.body
        # Fields the daemon does not know are ignored, as OpenAI-compatible servers do.
        reply = await chat(model=MODEL_ID, messages=MESSAGES, max_tokens=2, user="x",
                           extra_body={"foo": 1, "bar": {"baz": [1]}})
        assert reply.choices[0].message.content is not None
        # OpenAI's range takes top_p 0 (the NDJSON one does not): the likeliest token.
        reply = await chat(model=MODEL_ID, messages=MESSAGES, max_tokens=2, top_p=0)
        assert reply.choices[0].message.content is not None
    # Not JSON at all: 400 too, and the daemon serves on.
    async with tcp.http() as http:
        response = await http.post("/v1/chat/completions", content=b"{not json")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "bad_json"


@module_test
async def test_models_health_and_unknown_routes(tcp: Endpoint) -> None:
    async with tcp.sdk() as client:
        models = await client.models.list()
        assert [model.id for model in models.data] == [MODEL_ID]
        assert (await client.models.retrieve(MODEL_ID)).id == MODEL_ID
        await raises(client.models.retrieve("gpt-4"), openai.NotFoundError)
    async with tcp.http() as http:
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["model"] == MODEL_ID
        missing = await http.get("/v1/nowhere")
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "not_found"


@module_test
async def test_ndjson_and_http_clients_at_once(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    async with tcp.sdk() as sdk, tcp.daemon.client() as ndjson:
        solo = (await sdk.chat.completions.create(model=MODEL_ID, **options))
        http_reply, ndjson_lines = await asyncio.gather(
            sdk.chat.completions.create(model=MODEL_ID, **options),
            ndjson.request({"op": "chat", **options}))
    # Reproducible mode: beside each other, each gives the bytes of a solo run, and the
    # HTTP request maps to the same request as the NDJSON one.
    expected = solo.choices[0].message.content
    assert http_reply.choices[0].message.content == expected
    assert tokens_text(ndjson_lines) == expected
    assert http_reply.usage is not None
    assert done_of(ndjson_lines)["usage"]["completion_tokens"] == \
        http_reply.usage.completion_tokens


# --- the refusals (Unix socket, API key, one slot, no queue) ---------------------------


@module_test
async def test_health_over_a_unix_socket_needs_no_key(guarded: Endpoint) -> None:
    path = guarded.url.removeprefix("unix:")
    async with httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=path),
                                  timeout=WAIT_S) as http:
        response = await http.get("http://localhost/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


@module_test
async def test_the_api_key_is_required(guarded: Endpoint) -> None:
    async with guarded.sdk("wrong") as client:
        error = await raises(client.chat.completions.create(
            model=MODEL_ID, messages=MESSAGES, max_tokens=2), openai.AuthenticationError)
        assert error.status_code == 401 and error.code == "invalid_api_key"
        await raises(client.models.list(), openai.AuthenticationError)
    async with guarded.http() as http:
        bare = await http.get("/v1/models")
        assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    async with guarded.sdk() as client:
        reply = await client.chat.completions.create(model=MODEL_ID, messages=MESSAGES,
                                                     max_tokens=2)
        assert reply.choices[0].message.content is not None
        assert [model.id for model in (await client.models.list()).data] == [MODEL_ID]


@module_test
async def test_a_body_over_max_line_bytes_is_413(guarded: Endpoint) -> None:
    body = json.dumps({"model": MODEL_ID, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "x" * 4096}]})
    async with guarded.http() as http:
        response = await http.post("/v1/chat/completions", content=body,
                                   headers={"Authorization": f"Bearer {KEY}",
                                            "Content-Type": "application/json"})
        assert response.status_code == 413, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert (await http.get("/health")).status_code == 200


@module_test
async def test_a_full_queue_is_429(guarded: Endpoint) -> None:
    # The one slot is freed just after the previous reply's last byte.
    stats = await guarded.wait_stats(lambda s: not s["slots"][0]["busy"])
    before = stats["requests"]["by_outcome"]["cancelled"]
    async with guarded.sdk() as client:
        stream = await client.chat.completions.create(
            model=MODEL_ID, messages=COUNTING, max_tokens=400, temperature=0, stream=True)
        async with stream:
            first = await asyncio.wait_for(anext(aiter(stream)), WAIT_S)
            assert first.choices[0].delta.role == "assistant"
            # The one slot is busy and no request may wait for it.
            error = await raises(client.chat.completions.create(
                model=MODEL_ID, messages=MESSAGES, max_tokens=2), openai.RateLimitError)
            assert error.status_code == 429 and error.code == "queue_full"
    await guarded.wait_stats(lambda s: s["requests"]["by_outcome"]["cancelled"] == before + 1
                             and not s["slots"][0]["busy"])
    async with guarded.sdk() as client:
        reply = await client.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=2)
        assert reply.choices[0].finish_reason in ("stop", "length")


# --- start-up -----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_remote_address_without_allow_remote_stops_startup(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[openai]\nlisten = "0.0.0.0:8080"\n')
    code, output = await run_cli("--config", str(config), "--socket", str(tmp_path / "s"))
    assert code != 0
    assert output.count("\n") == 1, output
    assert "Traceback" not in output and "allow_remote" in output
