"""Ollama's native API on the HTTP listener, end to end: the real daemon, the real
`ollama` Python client (chat, generate, list, show, ps), and raw HTTP where the client
would hide what is checked (the NDJSON lines, /api/version, the error bodies).

One daemon for the module (TCP, reproducible mode, so that a greedy request gives the
same text whole and streamed).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
import pytest_asyncio

from tests.kit.daemon import running_daemon

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Generous: a grammar-held call on a loaded 2-core machine takes tens of seconds.
WAIT_S = 180.0
MODEL = "gemma-3-270m-q4_k_m:latest"
COLORS: list[Any] = [{"role": "user", "content": "Name three colors of the rainbow."}]
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 16}
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def url() -> AsyncIterator[str]:
    config = {"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 2},
              "model": {"reproducible": True}}
    async with running_daemon(config) as daemon:
        ready = next(note for note in daemon.notifications if note.startswith("READY=1"))
        found = re.search(r"OpenAI API on (http://\S+)", ready)
        assert found, ready
        yield found[1]


def client(url: str) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=url, timeout=WAIT_S)


async def raw_post(url: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
        return await http.post(path, content=body if isinstance(body, bytes)
                               else json.dumps(body))


def assert_counts(last: Any) -> None:
    """The last line: done, a reason, and the counts as Ollama's integers."""
    assert last.done is True and last.done_reason in ("stop", "length"), last
    assert last.prompt_eval_count > 0 and last.eval_count > 0, last
    for duration in (last.total_duration, last.prompt_eval_duration, last.eval_duration):
        assert isinstance(duration, int) and duration > 0, last
    assert last.load_duration == 0 and last.total_duration >= last.eval_duration, last


# --- generation ---------------------------------------------------------------------------


async def test_chat_whole_and_streamed_give_the_same_text(url: str) -> None:
    async with client(url) as ollama_client:
        whole = await ollama_client.chat(model="llama3", messages=COLORS, options=GREEDY,
                                         keep_alive="5m")
        parts = [part async for part in await ollama_client.chat(
            model="llama3", messages=COLORS, options=GREEDY, stream=True, keep_alive=-1)]
    assert whole.message.role == "assistant" and whole.message.content, whole
    assert whole.model == MODEL and whole.created_at, whole
    assert_counts(whole)
    assert all(not part.done for part in parts[:-1]) and parts[-1].done, parts
    assert "".join(part.message.content or "" for part in parts) == whole.message.content
    assert_counts(parts[-1])
    assert parts[-1].eval_count == whole.eval_count


async def test_generate_whole_and_streamed_give_the_same_text(url: str) -> None:
    async with client(url) as ollama_client:
        for raw in (False, True):
            options: dict[str, Any] = {"model": "m", "prompt": "The three primary colors are",
                                       "options": GREEDY, "raw": raw}
            whole = await ollama_client.generate(**options)
            parts = [part async for part in await ollama_client.generate(**options,
                                                                         stream=True)]
            assert whole.response and whole.done, whole
            assert_counts(whole)
            assert "".join(part.response or "" for part in parts) == whole.response
            assert parts[-1].done and parts[-1].response == "", parts[-1]
        system = await ollama_client.generate(model="m", prompt="Hi", system="Answer in French.",
                                              options=GREEDY)
        assert system.response and system.done_reason in ("stop", "length")


async def test_ollama_streams_ndjson_unless_told_not_to(url: str) -> None:
    response = await raw_post(url, "/api/generate", {"model": "m", "prompt": "Hi",
                                                      "options": {"num_predict": 4}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(text) for text in response.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] is True, lines
    assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 4, lines
    assert all(set(line) >= {"model", "created_at", "response", "done"} for line in lines)


async def test_an_empty_request_loads_the_model(url: str) -> None:
    async with client(url) as ollama_client:
        loaded = await ollama_client.generate(model="m", keep_alive=0)
        assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
        chat = await ollama_client.chat(model="m", messages=[])
        assert chat.done and chat.done_reason == "load" and chat.message.content == ""


async def test_format_json_schema_holds_the_answer(url: str) -> None:
    async with client(url) as ollama_client:
        answer = await ollama_client.chat(
            model="m", format=PERSON, options={"temperature": 0, "num_predict": 48},
            messages=[{"role": "user", "content": "Ada Lovelace, 36, as JSON."}])
        document = json.loads(answer.message.content or "")
        jsonschema.validate(document, PERSON)
        plain = await ollama_client.generate(model="m", format="json", prompt="A fruit as JSON:",
                                             options={"temperature": 0, "num_predict": 32})
        assert isinstance(json.loads(plain.response or ""), dict)


async def test_a_tool_call_has_its_arguments_as_an_object(url: str) -> None:
    # Asked by name: whether the small model calls a tool unasked turns on near-ties that
    # differ by CPU (on an AVX2-only one it answered in prose), and Ollama has no tool_choice.
    question = [{"role": "system", "content": "Answer only by calling a tool."},
                {"role": "user", "content": "Call get_weather for Paris."}]
    async with client(url) as ollama_client:
        answer = await ollama_client.chat(model="m", messages=question, tools=[WEATHER],
                                          options={"temperature": 0, "num_predict": 48})
        calls = answer.message.tool_calls
        assert calls, answer
        call = calls[0].function
        assert call.name == "get_weather" and isinstance(call.arguments, dict), call
        jsonschema.validate(dict(call.arguments), WEATHER["function"]["parameters"])
        streamed = [part async for part in await ollama_client.chat(
            model="m", messages=question, tools=[WEATHER], stream=True,
            options={"temperature": 0, "num_predict": 48})]
        assert [part.message.tool_calls for part in streamed if part.message.tool_calls] \
            == [calls]
        # The call and its result sent back: the answer goes on from them.
        turns = [*question, answer.message,
                 {"role": "tool", "tool_name": "get_weather", "content": "21 C, sunny"}]
        after = await ollama_client.chat(model="m", messages=turns, tools=[WEATHER],
                                         options={"temperature": 0, "num_predict": 24})
        assert after.done and after.done_reason in ("stop", "length"), after


# --- the model ----------------------------------------------------------------------------


async def test_list_show_ps_and_version_describe_the_one_model(url: str) -> None:
    async with client(url) as ollama_client:
        listed = await ollama_client.list()
        shown = await ollama_client.show("llama3")
        running = await ollama_client.ps()
    [model] = listed.models
    assert model.model == MODEL and model.size and model.size > 10**8, model
    assert model.details and model.details.format == "gguf", model
    assert model.details.family == "gemma3" and model.details.quantization_level == "Q4_K_M"
    assert model.digest and len(model.digest) == 64 and model.modified_at is not None
    assert shown.capabilities == ["completion", "tools"], shown
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "gemma3", shown
    # This GGUF has no template of its own: the daemon's built-in "gemma" renders it.
    assert shown.modelinfo["sfcore.chat_template"] == "gemma" and shown.template == "", shown
    assert shown.details == model.details and shown.modelfile, shown
    [loaded] = running.models
    assert loaded.model == MODEL and loaded.size_vram == 0 and loaded.expires_at, loaded
    assert loaded.context_length == 4096, loaded
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
        version = (await http.get("/api/version")).json()
        probe = await http.get("/")
    assert version == {"version": "0.9.0"}
    assert probe.status_code == 200 and probe.text == "Ollama is running"


# --- errors -------------------------------------------------------------------------------


async def test_errors_come_in_ollamas_shape_with_their_status(url: str) -> None:
    async with client(url) as ollama_client:
        with pytest.raises(ollama.ResponseError) as bad_option:
            await ollama_client.chat(model="m", messages=COLORS, options={"temperature": -1})
        assert bad_option.value.status_code == 400 and "temperature" in bad_option.value.error
        with pytest.raises(ollama.ResponseError) as image:
            await ollama_client.chat(model="m", messages=[
                {"role": "user", "content": "What is it?", "images": [b"\x89PNG"]}])
        assert image.value.status_code == 400 and "images" in image.value.error
        with pytest.raises(ollama.ResponseError) as streamed:
            async for _part in await ollama_client.generate(model="m", prompt="x",
                                                            suffix="y", stream=True):
                pass
        assert streamed.value.status_code == 400 and "suffix" in streamed.value.error
        with pytest.raises(ollama.ResponseError) as missing:
            await ollama_client.pull("llama3")
        assert missing.value.status_code == 404
    for path, body, status in (("/api/chat", b"{", 400), ("/api/chat", {"messages": []}, 400),
                               ("/api/show", {"model": 3}, 400), ("/api/embed", {}, 404)):
        response = await raw_post(url, path, body)
        assert response.status_code == status, (path, response.text)
        assert set(response.json()) == {"error"} and response.json()["error"], response.text


async def test_requests_are_counted_by_route(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
        text = (await http.get("/metrics")).text
    for api, op in (("ollama_chat", "chat"), ("ollama_generate", "chat"),
                    ("ollama_generate", "generate")):
        found = re.search(rf'^sfcore_requests_total{{api="{api}",op="{op}"}} (\S+)$', text,
                          re.M)
        assert found and float(found[1]) >= 1, (api, op)
