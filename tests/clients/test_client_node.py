"""The Node.js client in clients/node (library and example program) against the real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import sfcore_client

from tests.kit import REPO, running_daemon
from tests.kit.client_logprobs import assert_generated_counted, python_logprobs
from tests.kit.person_document import (
    PERSON_PROMPT,
    PERSON_SCHEMA,
    REPRODUCIBLE,
    assert_person,
    python_client_document,
)
from tests.kit.tools import FLAGS as TOOL_FLAGS
from tests.kit.tools import SEEDS as TOOL_SEEDS
from tests.kit.tools import assert_round_trip

CLIENT = REPO / "clients" / "node"
EXAMPLE = CLIENT / "example.js"
RUN_TIMEOUT_S = 120.0

# Gemma 3 270M continues this in Japanese (3-byte UTF-8 characters, some split across
# tokens); greedy, from an empty cache, so every client gets the same bytes.
PROMPT = "日本の首都は"
OPTIONS: dict[str, Any] = {"max_tokens": 32, "temperature": 0, "seed": 7, "cache_prompt": False}
EXAMPLE_FLAGS = ["--max-tokens", "32", "--temperature", "0", "--seed", "7", "--no-cache-prompt"]


def node() -> str:
    path = shutil.which("node")
    assert path is not None, "Node.js (node) is not installed"
    return path


async def run(*command: str, env: dict[str, str] | None = None,
              timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
    """Run a program to completion (bounded); returns (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=str(REPO))
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def python_client_text(path: str, prompt: str, **options: Any) -> str:
    """The Python client's text for the request (the reference the other clients match)."""
    with sfcore_client.Client(path, timeout=60) as client:
        return client.generate(prompt, **options).text


async def reference(path: str, prompt: str, **options: Any) -> str:
    return await asyncio.wait_for(
        asyncio.to_thread(python_client_text, path, prompt, **options), RUN_TIMEOUT_S)


def test_node_unit_tests() -> None:
    """clients/node/test: the client against a fake daemon (no model)."""
    result = subprocess.run([node(), "--test", str(CLIENT / "test")], cwd=REPO,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# fail 0" in result.stdout and "# pass 0" not in result.stdout, result.stdout


@pytest.mark.asyncio
async def test_example_streams_the_python_clients_text() -> None:
    async with running_daemon() as daemon:
        expected = await reference(daemon.socket_path, PROMPT, **OPTIONS)
        code, out, err = await run(node(), str(EXAMPLE), "--socket", daemon.socket_path,
                                   *EXAMPLE_FLAGS, PROMPT)
        # The default path comes from $SFCORE_SOCKET.
        env = dict(os.environ, SFCORE_SOCKET=daemon.socket_path)
        env_code, env_out, env_err = await run(node(), str(EXAMPLE), *EXAMPLE_FLAGS, PROMPT,
                                               env=env)
    assert any(ord(char) > 127 for char in expected), expected
    assert (code, err) == (0, "")
    assert out == expected + "\n"
    assert (env_code, env_out, env_err) == (0, expected + "\n", "")


@pytest.mark.asyncio
async def test_example_exits_1_on_an_error_line() -> None:
    async with running_daemon() as daemon:
        code, out, err = await run(node(), str(EXAMPLE), "--socket", daemon.socket_path,
                                   "--max-tokens", "0", PROMPT)
    assert code == 1, (out, err)
    assert out == ""
    assert "invalid_request" in err and "max_tokens" in err, err


@pytest.mark.asyncio
async def test_example_exits_3_when_the_daemon_is_unreachable(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.sock")
    code, out, err = await run(node(), str(EXAMPLE), "--socket", missing, "Hi")
    assert code == 3, (out, err)
    assert out == ""
    assert missing in err and "may not be running" in err, err
    # A socket file nobody listens on (a daemon that died without removing it).
    stale = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(stale)
        code, out, err = await run(node(), str(EXAMPLE), "--socket", stale, "Hi")
    assert code == 3, (out, err)
    assert stale in err and "ECONNREFUSED" in err, err


LIBRARY_SCRIPT = """
import { connect, SfcoreConnectionError, SfcoreError } from %(index)s;

const out = {};
const client = await connect(process.argv[2]);
const greedy = { max_tokens: 24, temperature: 0, cache_prompt: false };
const messages = [{ role: "user", content: "Say hello in French." }];

// Pipelined on the one connection, answered in request order.
[out.health, out.tokens, out.plainTokens] = await Promise.all([
  client.health(), client.tokenize("Hello world"),
  client.tokenize("Hello world", { addSpecial: false })]);
out.detokenized = await client.detokenize(out.plainTokens);
out.info = await client.info();

out.chat = await client.chat(messages, greedy);
let streamed = "";
const chatStream = client.streamChat(messages, { ...greedy, maxTokens: 24 });
for await (const piece of chatStream) streamed += piece;
out.streamedChat = streamed;
out.streamedChatResult = chatStream.result;
let pieces = 0;
out.callbackChat = await client.chat(messages, { ...greedy, onToken: () => { pieces += 1; } });
out.callbackPieces = pieces;

try {
  await client.generate("x", { max_tokens: 0 });
} catch (error) {
  out.error = { sfcore: error instanceof SfcoreError, code: error.code, message: error.message };
}

// cancel() of a running stream: its reply ends with "cancelled", before cancel resolves.
const long = { max_tokens: 400, temperature: 0 };
const running = client.streamGenerate("Count from one to one thousand:", long);
await running.next();
out.cancelFound = await client.cancel(running.id);
out.cancelledBeforeAnswer = running.finished;
for await (const piece of running) void piece;
out.cancelled = running.result;
out.cancelUnknown = await client.cancel("no-such-request");

// Leaving the iteration early sends cancel: the slot is free at once.
const left = client.streamGenerate("Count from one to one thousand:", long);
for await (const piece of left) { void piece; break; }
out.healthAfterBreak = (await client.health()).status; // answered after left's done
out.left = left.result;
out.stats = await client.stats();

// Aborting a call through its signal.
const abort = new AbortController();
try {
  await client.generate("Count from one to one thousand:", {
    ...long, signal: abort.signal, onToken: () => abort.abort() });
} catch (error) {
  out.aborted = error.name;
}
out.healthAfterAbort = (await client.health()).status;

await client.close();
try {
  await client.health();
} catch (error) {
  out.afterClose = { connection: error instanceof SfcoreConnectionError, code: error.code };
}
try {
  await connect(process.argv[2] + ".missing");
} catch (error) {
  out.unreachable = { connection: error instanceof SfcoreConnectionError, code: error.code,
    message: error.message };
}
console.log(JSON.stringify(out));
"""


def python_client_chat_text(path: str, messages: list[dict[str, str]], **options: Any) -> str:
    with sfcore_client.Client(path, timeout=60) as client:
        return client.chat(messages, **options).text


@pytest.mark.asyncio
async def test_library_ops_cancel_and_errors(tmp_path: Path) -> None:
    script = tmp_path / "library.mjs"
    index = (CLIENT / "index.js").as_uri()
    script.write_text(LIBRARY_SCRIPT % {"index": json.dumps(index)})
    async with running_daemon() as daemon:
        code, out, err = await run(node(), str(script), daemon.socket_path)
        assert code == 0, err
        chat_reference = await asyncio.wait_for(asyncio.to_thread(
            python_client_chat_text, daemon.socket_path,
            [{"role": "user", "content": "Say hello in French."}],
            max_tokens=24, temperature=0, cache_prompt=False), RUN_TIMEOUT_S)
    result = json.loads(out)

    assert result["health"]["type"] == "health" and result["health"]["status"] == "ok"
    assert result["tokens"][1:] == result["plainTokens"] and len(result["tokens"]) >= 3
    assert all(isinstance(token, int) for token in result["tokens"])
    assert result["detokenized"] == "Hello world"
    assert result["info"]["model"]["architecture"] == "gemma3"
    assert result["info"]["config"]["n_ctx"] == 4096

    chat = result["chat"]
    assert chat["text"] != "" and chat["text"] == chat_reference
    assert chat["finishReason"] in ("stop", "length")
    assert chat["usage"]["completionTokens"] > 0 and chat["timings"]["totalMs"] > 0
    assert isinstance(chat["id"], int) and chat["stopSequence"] is None
    assert result["streamedChat"] == chat["text"] == result["streamedChatResult"]["text"]
    assert result["callbackChat"]["text"] == chat["text"]
    assert 1 < result["callbackPieces"] <= chat["usage"]["completionTokens"]

    assert result["error"]["sfcore"] is True
    assert result["error"]["code"] == "invalid_request"
    assert "max_tokens" in result["error"]["message"]

    assert result["cancelFound"] is True and result["cancelledBeforeAnswer"] is True
    assert result["cancelled"]["finishReason"] == "cancelled"
    assert 0 < result["cancelled"]["usage"]["completionTokens"] < 400
    assert result["cancelUnknown"] is False
    assert result["healthAfterBreak"] == "ok"
    assert result["left"]["finishReason"] == "cancelled"
    assert result["left"]["usage"]["completionTokens"] < 400
    assert result["stats"]["requests"]["by_outcome"]["cancelled"] == 2
    assert result["stats"]["requests"]["by_op"]["cancel"] == 3

    assert result["aborted"] == "AbortError"
    assert result["healthAfterAbort"] == "ok"
    assert result["afterClose"] == {"connection": True, "code": "disconnected"}
    assert result["unreachable"]["connection"] is True
    assert result["unreachable"]["code"] == "unreachable"
    assert daemon.socket_path + ".missing" in result["unreachable"]["message"]


# --- the prompt store: cache() lists and clears it ---

CACHE_SCRIPT = """
import { connect } from %(index)s;

const out = {};
const client = await connect(process.argv[2]);
out.empty = await client.cache();
// Evaluating more than min_tokens prompt tokens keeps the prompt's state.
out.generated = await client.generate(process.argv[3], { max_tokens: 4, temperature: 0 });
out.listed = await client.cache();
out.cleared = await client.cache({ clear: true });
out.after = await client.cache({ clear: false });
await client.close();
console.log(JSON.stringify(out));
"""

STORE_PROMPT = ("The warehouse keeps its grey stones in boxes on three shelves; each shelf holds "
                "twelve boxes, and every box is weighed before it is moved.")
STORE_MIN_TOKENS = 16


@pytest.mark.asyncio
async def test_library_cache_lists_and_clears_the_prompt_store(tmp_path: Path) -> None:
    script = tmp_path / "cache.mjs"
    script.write_text(CACHE_SCRIPT % {"index": json.dumps((CLIENT / "index.js").as_uri())})
    config = {"cache": {"min_tokens": STORE_MIN_TOKENS, "ram_mb": 64}, "server": {"slots": 1}}
    async with running_daemon(config) as daemon:
        code, out, err = await run(node(), str(script), daemon.socket_path, STORE_PROMPT,
                                   timeout=60)
        store = daemon.directory / "prompts"
    assert code == 0, err
    result = json.loads(out)

    empty, listed, cleared, after = (result[key]
                                     for key in ("empty", "listed", "cleared", "after"))
    for reply in (empty, listed, cleared, after):
        assert reply["type"] == "cache" and reply["enabled"] is True, reply
        assert isinstance(reply["dir"], str) and Path(reply["dir"]).parent == store, reply
        assert isinstance(reply["states"], list), reply
        for key in ("removed_states", "removed_files", "removed_bytes"):
            assert isinstance(reply[key], int) and reply[key] >= 0, reply
    assert empty["states"] == [] and empty["removed_states"] == 0
    assert after["states"] == [] and after["removed_states"] == after["removed_files"] == 0

    prompt_tokens = result["generated"]["usage"]["promptTokens"]
    assert prompt_tokens > STORE_MIN_TOKENS
    states = listed["states"]
    assert states and listed["removed_states"] == listed["removed_bytes"] == 0, listed
    for state in states:
        assert set(state) == {"tokens", "bytes", "ram", "disk", "preview", "pinned_s"}, state
        assert STORE_MIN_TOKENS <= state["tokens"] <= prompt_tokens, state
        assert state["bytes"] > 0 and state["ram"] is True, state
        assert isinstance(state["disk"], bool), state
        assert state["preview"] and STORE_PROMPT.startswith(state["preview"]), state
    assert cleared["states"] == [] and cleared["removed_states"] == len(states), cleared


# --- structured output: structured.js asks for a document by JSON Schema ---

STRUCTURED = CLIENT / "structured.js"
STRUCTURED_FLAGS = ["--temperature", "0", "--no-cache-prompt"]


@pytest.mark.asyncio
async def test_structured_example_prints_a_document_of_the_schema(tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    async with running_daemon(REPRODUCIBLE) as daemon:
        flags = ["--socket", daemon.socket_path, *STRUCTURED_FLAGS, "--max-tokens", "200"]
        generated = await run(node(), str(STRUCTURED), *flags, "--json-schema", str(schema),
                              PERSON_PROMPT)
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_client_document, daemon.socket_path, PERSON_PROMPT), RUN_TIMEOUT_S)
        chatted = await run(node(), str(STRUCTURED), *flags, "--chat", "--json-schema",
                            str(schema), "Describe a person.")
        anything = await run(node(), str(STRUCTURED), *flags, "--format", "json",
                             PERSON_PROMPT)
        answer = await run(node(), str(STRUCTURED), "--socket", daemon.socket_path,
                           *STRUCTURED_FLAGS, "--max-tokens", "8", "--grammar", str(grammar),
                           "Is the sky blue? Answer:")
    for code, out, err in (generated, chatted, anything, answer):
        assert (code, err) == (0, "") and out.endswith("\n"), (code, out, err)
    # The Python client's document, byte for byte (the properties in the schema's order).
    assert generated[1] == expected + "\n"
    assert_person(json.loads(generated[1]))
    assert_person(json.loads(chatted[1]))
    assert isinstance(json.loads(anything[1]), dict)
    assert answer[1] in ("yes\n", "no\n")


@pytest.mark.asyncio
async def test_structured_example_surfaces_a_refused_schema_as_invalid_request(
        tmp_path: Path) -> None:
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps({"type": "number", "minimum": 3}))
    person = tmp_path / "person.json"
    person.write_text(json.dumps(PERSON_SCHEMA))
    async with running_daemon() as daemon:
        bad = await run(node(), str(STRUCTURED), "--socket", daemon.socket_path,
                        "--json-schema", str(refused), "Hi")
        both = await run(node(), str(STRUCTURED), "--socket", daemon.socket_path,
                         "--json-schema", str(person), "--format", "json", "Hi")
    # "code: message" is what the example prints for an SfcoreError from an error line.
    code, out, err = bad
    assert (code, out) == (1, ""), bad
    assert re.fullmatch(r"structured: invalid_request: .*minimum.*\n", err), err
    code, out, err = both
    assert (code, out) == (1, ""), both
    assert re.fullmatch(r"structured: invalid_request: .*exclude each other.*\n", err), err


# --- logprobs and metrics ---

LOGPROBS_SCRIPT = """
import { connect } from %(index)s;

const client = await connect(process.argv[2]);
const greedy = { max_tokens: 16, temperature: 0, seed: 7, cache_prompt: false, logprobs: 3 };
const plain = (result) => ({
  text: result.text, completionTokens: result.usage.completionTokens,
  joined: Buffer.concat(result.logprobs.map((entry) => entry.bytes)).toString(),
  typed: result.logprobs.every((entry) => entry.bytes instanceof Uint8Array &&
    entry.topLogprobs.every((top) => top.bytes instanceof Uint8Array)),
  entries: result.logprobs.map((entry) => ({ ...entry, bytes: [...entry.bytes],
    topLogprobs: entry.topLogprobs.map((top) => ({ ...top, bytes: [...top.bytes] })) })),
});
const out = {};
out.whole = plain(await client.generate(process.argv[3], greedy));
const stream = client.streamGenerate(process.argv[3], greedy);
for await (const piece of stream) void piece;
out.streamed = plain(stream.result);
out.without = (await client.generate(process.argv[3], { max_tokens: 2 })).logprobs;
out.metrics = await client.metrics();
await client.close();
console.log(JSON.stringify(out));
"""


@pytest.mark.asyncio
async def test_library_logprobs_and_metrics(tmp_path: Path) -> None:
    script = tmp_path / "logprobs.mjs"
    script.write_text(LOGPROBS_SCRIPT % {"index": json.dumps((CLIENT / "index.js").as_uri())})
    async with running_daemon() as daemon:
        code, out, err = await run(node(), str(script), daemon.socket_path, PROMPT)
        assert code == 0, err
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_logprobs, daemon.socket_path, PROMPT), RUN_TIMEOUT_S)
    result = json.loads(out)

    for reply in (result["whole"], result["streamed"]):
        entries = reply["entries"]
        assert reply["typed"] is True
        # Greedy, no stop sequence: one entry per completion token, whose bytes are the text.
        assert len(entries) == reply["completionTokens"] > 0
        assert reply["joined"] == reply["text"]
        for entry in entries:
            assert set(entry) == {"token", "text", "bytes", "logprob", "topLogprobs"}, entry
            assert entry["logprob"] <= 0 and len(entry["topLogprobs"]) == 3, entry
            assert entry["topLogprobs"][0] == {key: entry[key] for key in
                                               ("token", "text", "bytes", "logprob")}, entry
            assert [top["logprob"] for top in entry["topLogprobs"]] == sorted(
                (top["logprob"] for top in entry["topLogprobs"]), reverse=True), entry
        assert [(entry["token"], entry["logprob"]) for entry in entries] == expected
    assert result["streamed"]["text"] == result["whole"]["text"]
    assert any(ord(char) > 127 for char in result["whole"]["text"])
    assert result["without"] is None
    assert_generated_counted(result["metrics"], 2 * len(expected))


# --- tool calls: tools-example.js offers two functions, runs the calls, sends the results ---

TOOLS_EXAMPLE = CLIENT / "tools-example.js"


@pytest.mark.asyncio
async def test_tools_example_round_trip_calls_validate() -> None:
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        base = [node(), str(TOOLS_EXAMPLE), "--socket", daemon.socket_path, *TOOL_FLAGS]
        required = await asyncio.gather(*(
            run(*base, "--seed", str(seed), "--tool-choice", "required") for seed in TOOL_SEEDS))
        named = await asyncio.gather(*(
            run(*base, "--seed", str(seed), "--tool-choice", "add") for seed in range(2)))
        single = await run(*base, "--seed", "9", "--tool-choice", "required", "--no-parallel")
        refused = await run(node(), str(TOOLS_EXAMPLE), "--socket", daemon.socket_path,
                            "--max-tokens", "0")
    for code, out, err in required:
        assert (code, err) == (0, ""), (code, out, err)
        assert_round_trip(out, {"get_weather", "add"})
    for code, out, err in named:
        assert (code, err) == (0, ""), (code, out, err)
        assert_round_trip(out, {"add"}, single=True)
    code, out, err = single
    assert (code, err) == (0, ""), single
    assert_round_trip(out, {"get_weather", "add"}, single=True)
    code, out, err = refused
    assert (code, out) == (1, ""), refused
    assert re.fullmatch(r"tools-example: invalid_request: .*max_tokens.*\n", err), err
