"""The Rust client in clients/rust (crate sfcore-client) against the real daemon.

The crate depends on serde and serde_json as usual. crates.io is not reachable here, so the
test builds it offline from Debian's packaged crate sources (librust-serde-*-dev, installed
by scripts/os-deps.sh into /usr/share/cargo/registry) through cargo source replacement given
as --config flags. It builds a copy of the crate under the cache dir, so the resolved
Cargo.lock and the target dir stay out of the work tree and a second run is quick.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sfcore_client import Client

from tests.kit import REPO, running_daemon
from tests.kit.client_logprobs import assert_generated_counted, python_logprobs
from tests.kit.person_document import (
    PERSON_PROMPT,
    PERSON_SCHEMA,
    REPRODUCIBLE,
    assert_person,
    python_client_document,
)

pytestmark = pytest.mark.asyncio

CRATE = REPO / "clients" / "rust"
DEBIAN_CRATES = Path("/usr/share/cargo/registry")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sfcore-ai" / "rust"
BUILD_TIMEOUT_S = 240.0
RUN_TIMEOUT_S = 120.0
OFFLINE = (
    "--offline",
    "--config", 'source.crates-io.replace-with="debian"',
    "--config", f'source.debian.directory="{DEBIAN_CRATES}"',
)

# Greedy and evaluated from an empty cache: the same bytes whoever asks.
SEEDED = {"max_tokens": 32, "temperature": 0, "seed": 7, "cache_prompt": False}
# Gemma 3 270M answers these with Japanese punctuation and kanji, and French accents.
NON_ASCII_PROMPTS = ["日本の首都は", "Écris une phrase en français sur le café:"]


def find_cargo() -> str | None:
    found = shutil.which("cargo")
    if found:
        return found
    fallback = Path.home() / ".cargo" / "bin" / "cargo"
    return str(fallback) if fallback.exists() else None


def sync_crate(dest: Path) -> None:
    """Copy the crate's sources (not target/ or a Cargo.lock); copy2 keeps mtimes, so cargo
    rebuilds only what changed."""
    dest.mkdir(parents=True, exist_ok=True)
    for sub in ("src", "examples"):
        shutil.rmtree(dest / sub, ignore_errors=True)
        shutil.copytree(CRATE / sub, dest / sub)
    shutil.copy2(CRATE / "Cargo.toml", dest / "Cargo.toml")
    # Resolve afresh each time against whatever Debian has installed now.
    (dest / "Cargo.lock").unlink(missing_ok=True)


def cargo(cargo_bin: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CARGO_TARGET_DIR=str(CACHE / "target"), CARGO_TERM_COLOR="never")
    result = subprocess.run([cargo_bin, *args, *OFFLINE], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"cargo {' '.join(args)} failed:\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def build() -> Iterator[dict[str, Any]]:
    """Builds the examples and runs the unit tests once per module; yields the example paths,
    the resolved Cargo.lock and the build and test output."""
    cargo_bin = find_cargo()
    if cargo_bin is None:
        pytest.skip("no cargo on this machine (install Rust to test the Rust client)")
    assert any(DEBIAN_CRATES.glob("serde_json-1.*")), (
        f"Debian's serde crates are missing from {DEBIAN_CRATES}: run scripts/os-deps.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    crate = CACHE / "crate"
    with (CACHE / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be building the same copy
        sync_crate(crate)
        built = cargo(cargo_bin, "build", "--examples", cwd=crate)
        tested = cargo(cargo_bin, "test", cwd=crate)
        lockfile = (crate / "Cargo.lock").read_text()
    examples = CACHE / "target" / "debug" / "examples"
    yield {"generate": examples / "generate", "ops": examples / "ops",
           "structured": examples / "structured", "cache": examples / "cache",
           "logprobs": examples / "logprobs", "tools": examples / "tools", "lock": lockfile,
           "build": built.stderr, "test": tested.stdout}


def run(*command: str | Path,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(part) for part in command], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False, env=env)


async def run_async(*command: str | Path,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run, *command, env=env)


def python_text(socket_path: str, prompt: str) -> str:
    """The reference: the Python client's text for the same request."""
    with Client(socket_path, timeout=60) as client:
        return client.generate(prompt, **SEEDED).text


def python_ops(socket_path: str, chat_text: str, tokenize_text: str,
               tokens: list[int]) -> dict[str, Any]:
    with Client(socket_path, timeout=60) as client:
        chat = client.chat([{"role": "user", "content": chat_text}], max_tokens=24,
                           temperature=0, seed=7, cache_prompt=False)
        return {"chat": chat.text, "tokenize": client.tokenize(tokenize_text, add_special=True),
                "detokenize": client.detokenize(tokens)}


async def test_builds_offline_from_debian_crates_without_warnings(build: dict[str, Any]) -> None:
    lock = build["lock"]
    for name in ("serde", "serde_derive", "serde_json"):
        assert f'name = "{name}"\nversion = "1.' in lock, lock
        version = lock.split(f'name = "{name}"\nversion = "')[1].split('"')[0]
        assert (DEBIAN_CRATES / f"{name}-{version}").is_dir(), (name, version)
    warnings = [line for line in build["build"].splitlines() if line.startswith("warning")]
    assert warnings == [], build["build"]
    assert "test result: ok" in build["test"] and "0 failed" in build["test"], build["test"]
    assert not (CRATE / "Cargo.lock").exists(), "the test build must not write into the crate"


async def test_generate_example_prints_the_python_clients_text(build: dict[str, Any]) -> None:
    async with running_daemon() as daemon:
        for prompt in NON_ASCII_PROMPTS:
            result = await run_async(
                build["generate"], "--socket", daemon.socket_path, "--max-tokens", "32",
                "--temperature", "0", "--seed", "7", "--no-cache-prompt", prompt)
            assert result.returncode == 0, result.stderr
            expected = await asyncio.wait_for(
                asyncio.to_thread(python_text, daemon.socket_path, prompt), 120)
            assert any(ord(char) > 127 for char in expected), expected
            assert result.stdout == expected + "\n"
            assert re.match(r"\[(length|stop), \d+ prompt \+ \d+ generated tokens",
                            result.stderr), result.stderr


async def test_generate_example_exit_codes(build: dict[str, Any], tmp_path: Path) -> None:
    missing = str(tmp_path / "nobody-listens.sock")
    for args in (["--socket", missing, "Hi"], ["Hi"]):
        # The second form finds the socket through $SFCORE_SOCKET.
        result = await run_async(build["generate"], *args, env=dict(os.environ,
                                                                      SFCORE_SOCKET=missing))
        assert result.returncode == 3, result
        assert missing in result.stderr and "daemon running" in result.stderr, result.stderr
        assert result.stdout == ""
    async with running_daemon() as daemon:
        env = dict(os.environ, SFCORE_SOCKET=daemon.socket_path)
        result = await run_async(build["generate"], "--max-tokens", "0", "Hi", env=env)
        assert result.returncode == 1, result
        assert "invalid_request" in result.stderr and "max_tokens" in result.stderr, result.stderr
        assert result.stdout == ""
        result = await run_async(build["generate"], "--max-tokens", "3", "Hi", env=env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.endswith("\n") and result.stdout.strip() != ""
    result = await run_async(build["generate"], "--max-tokens", "x", "Hi")
    assert result.returncode == 2 and "usage" in result.stderr


async def test_ops_example_chat_tokenize_cancel(build: dict[str, Any]) -> None:
    chat_text = "What is the capital of France?"
    tokenize_text = "Hello, wörld"
    async with running_daemon() as daemon:
        result = await run_async(build["ops"], daemon.socket_path, chat_text, tokenize_text)
        assert result.returncode == 0, result.stderr
        ops = json.loads(result.stdout)
        tokens = ops["tokenize"]
        assert isinstance(tokens, list) and all(isinstance(t, int) for t in tokens), ops
        reference = await asyncio.wait_for(asyncio.to_thread(
            python_ops, daemon.socket_path, chat_text, tokenize_text, tokens), 120)

    chat = ops["chat"]
    assert chat["text"] == reference["chat"] != "", ops
    assert chat["finish_reason"] in ("stop", "length"), chat
    assert chat["id"].startswith("rs-")
    assert tokens == reference["tokenize"]
    assert ops["detokenize"] == reference["detokenize"]
    assert tokenize_text in ops["detokenize"]

    # Stopping a stream three ways: each is cancelled in the daemon, on the same connection.
    cancelled = ops["stream_cancel"]
    assert cancelled["found"] is True, cancelled
    assert cancelled["first_piece"], cancelled
    assert cancelled["completion"]["finish_reason"] == "cancelled"
    assert cancelled["completion"]["usage"]["completion_tokens"] < 200
    assert cancelled["more_after_cancel"] is False
    stopped = ops["callback_stop"]
    assert stopped["pieces"] == 1, stopped
    assert stopped["completion"]["finish_reason"] == "cancelled", stopped
    dropped = ops["dropped_iterator"]
    assert isinstance(dropped["first_piece"], str), dropped
    assert dropped["health_after"]["status"] == "ok", dropped
    assert dropped["health_after"]["busy"] is False, dropped

    assert ops["cancel_finished"] is False
    assert ops["cancel_unknown"] is False
    assert ops["error"]["error"] == "invalid_request", ops["error"]
    assert ops["health"]["status"] == "ok"
    assert ops["info"]["model"]["name"] != ""
    stats = ops["stats"]
    assert stats["requests"]["by_outcome"]["cancelled"] == 3, stats
    assert stats["requests"]["by_op"]["cancel"] == 5, stats
    # Stopped streams were drained, not abandoned: the whole run used one connection.
    assert stats["connections"]["total"] == 1, stats


# --- the prompt store: examples/cache.rs lists and clears it (Client::cache) ---

# Kept by the store (with min_tokens 64): its prompt's state, and those of its last line starts.
STORED_PROMPT = "\n".join(
    f"Line {i}: the {('cat', 'dog', 'owl')[i % 3]} sleeps {i * 3 % 17} hours." for i in range(16)
) + "\nQuestion: which animal sleeps longest?"


def python_cache(socket_path: str) -> dict[str, Any]:
    with Client(socket_path, timeout=60) as client:
        return client.cache()


async def test_cache_example_lists_and_clears_the_prompt_store(build: dict[str, Any]) -> None:
    async with running_daemon({"cache": {"min_tokens": 64}}) as daemon:
        stored = await run_async(build["generate"], "--socket", daemon.socket_path,
                                 "--max-tokens", "4", "--temperature", "0", STORED_PROMPT)
        assert stored.returncode == 0, stored.stderr
        listed = await run_async(build["cache"], "--socket", daemon.socket_path)
        reference = await asyncio.wait_for(
            asyncio.to_thread(python_cache, daemon.socket_path), RUN_TIMEOUT_S)
        cleared = await run_async(build["cache"], "--socket", daemon.socket_path, "--clear")
        # The clear answers once the files are gone (the daemon writes its slot's cells
        # only when it stops).
        files_after_clear = sorted((daemon.directory / "prompts").glob("*/*"))
        after = await run_async(build["cache"], "--socket", daemon.socket_path)
    for result in (listed, cleared, after):
        assert (result.returncode, result.stderr) == (0, ""), result
        assert result.stdout.endswith("\n") and result.stdout.count("\n") == 1, result
    listed_line, cleared_line, after_line = (
        json.loads(result.stdout) for result in (listed, cleared, after))

    assert listed_line["type"] == "cache" and listed_line["id"].startswith("rs-"), listed_line
    assert listed_line["enabled"] is True, listed_line
    assert Path(listed_line["dir"]).parent == daemon.directory / "prompts", listed_line
    states = listed_line["states"]
    assert states, listed_line
    for state in states:
        assert set(state) == {"tokens", "bytes", "ram", "disk", "preview", "pinned_s"}, state
        assert state["tokens"] >= 64 and state["bytes"] > 0, state
        assert isinstance(state["ram"], bool) and isinstance(state["disk"], bool), state
        assert STORED_PROMPT.startswith(state["preview"]), state
    assert listed_line["removed_states"] == listed_line["removed_files"] == 0, listed_line
    assert listed_line["removed_bytes"] == 0, listed_line
    # The Python client lists the same store (a state's `disk` may have turned true since,
    # once its file was written).
    assert (reference["enabled"], reference["dir"]) == (True, listed_line["dir"]), reference
    assert [(state["tokens"], state["bytes"], state["preview"]) for state in reference["states"]] \
        == [(state["tokens"], state["bytes"], state["preview"]) for state in states], reference

    assert cleared_line["type"] == "cache" and cleared_line["enabled"] is True, cleared_line
    assert cleared_line["id"].startswith("rs-"), cleared_line
    assert cleared_line["states"] == [], cleared_line
    assert cleared_line["removed_states"] == len(states), cleared_line
    assert cleared_line["removed_files"] >= 0 and cleared_line["removed_bytes"] >= 0, cleared_line
    assert files_after_clear == [], files_after_clear
    assert after_line["enabled"] is True and after_line["states"] == [], after_line
    assert after_line["removed_states"] == after_line["removed_files"] == 0, after_line


async def test_cache_example_exit_codes(build: dict[str, Any], tmp_path: Path) -> None:
    missing = str(tmp_path / "nobody-listens.sock")
    result = await run_async(build["cache"], "--socket", missing)
    assert result.returncode == 3, result
    assert missing in result.stderr and "daemon running" in result.stderr, result.stderr
    assert result.stdout == ""
    result = await run_async(build["cache"], "--purge")
    assert (result.returncode, result.stdout) == (2, ""), result
    assert "usage" in result.stderr, result.stderr


# --- structured output: examples/structured.rs asks for a document by JSON Schema ---

STRUCTURED_FLAGS = ["--temperature", "0", "--no-cache-prompt"]


async def test_structured_example_prints_a_document_of_the_schema(build: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    structured = build["structured"]
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    async with running_daemon(REPRODUCIBLE) as daemon:
        flags = ["--socket", daemon.socket_path, *STRUCTURED_FLAGS, "--max-tokens", "200"]
        generated = await run_async(structured, *flags, "--json-schema", schema, PERSON_PROMPT)
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_client_document, daemon.socket_path, PERSON_PROMPT), RUN_TIMEOUT_S)
        chatted = await run_async(structured, *flags, "--chat", "--json-schema", schema,
                                  "Describe a person.")
        anything = await run_async(structured, *flags, "--format", "json", PERSON_PROMPT)
        answer = await run_async(structured, "--socket", daemon.socket_path, *STRUCTURED_FLAGS,
                                 "--max-tokens", "8", "--grammar", grammar,
                                 "Is the sky blue? Answer:")
    for result in (generated, chatted, anything, answer):
        assert (result.returncode, result.stderr) == (0, ""), result
        assert result.stdout.endswith("\n"), result
    # The Python client's document, byte for byte (the properties in the schema's order).
    assert generated.stdout == expected + "\n"
    assert_person(json.loads(generated.stdout))
    assert_person(json.loads(chatted.stdout))
    assert isinstance(json.loads(anything.stdout), dict)
    assert answer.stdout in ("yes\n", "no\n")


async def test_structured_example_surfaces_a_refused_schema_as_invalid_request(
        build: dict[str, Any], tmp_path: Path) -> None:
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps({"type": "number", "minimum": 3}))
    person = tmp_path / "person.json"
    person.write_text(json.dumps(PERSON_SCHEMA))
    async with running_daemon() as daemon:
        bad = await run_async(build["structured"], "--socket", daemon.socket_path,
                              "--json-schema", refused, "Hi")
        both = await run_async(build["structured"], "--socket", daemon.socket_path,
                               "--json-schema", person, "--format", "json", "Hi")
    # "code: message" is how Error::Protocol (an error line) displays; no other variant
    # starts with the code.
    assert (bad.returncode, bad.stdout) == (1, ""), bad
    assert re.fullmatch(r"structured: invalid_request: .*minimum.*\n", bad.stderr), bad
    assert (both.returncode, both.stdout) == (1, ""), both
    assert re.fullmatch(r"structured: invalid_request: .*exclude each other.*\n",
                        both.stderr), both


# --- logprobs and metrics: examples/logprobs.rs ---

LOGPROBS_PROMPT = "日本の首都は"


async def test_logprobs_example_types_the_entries_and_reads_metrics(
        build: dict[str, Any]) -> None:
    async with running_daemon() as daemon:
        result = await run_async(build["logprobs"], daemon.socket_path, LOGPROBS_PROMPT, "3")
        assert result.returncode == 0, result.stderr
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_logprobs, daemon.socket_path, LOGPROBS_PROMPT), 120)
    out = json.loads(result.stdout)

    for completion in (out["whole"], out["streamed"]):
        entries = completion["logprobs"]
        # Greedy, no stop sequence: one entry per completion token, whose bytes are the text.
        assert len(entries) == completion["usage"]["completion_tokens"] > 0
        assert bytes(b for entry in entries for b in entry["bytes"]).decode() == \
            completion["text"]
        for entry in entries:
            tops = entry.pop("top_logprobs")
            assert entry["logprob"] <= 0 and len(tops) == 3, entry
            assert tops[0] == entry, (entry, tops)
            assert [top["logprob"] for top in tops] == sorted(
                (top["logprob"] for top in tops), reverse=True), tops
        assert [(entry["token"], entry["logprob"]) for entry in entries] == expected
    assert out["streamed"]["text"] == out["whole"]["text"]
    assert any(ord(char) > 127 for char in out["whole"]["text"])
    assert out["without"] is None
    assert_generated_counted(out["metrics"], 2 * len(expected))


# --- tool calls: examples/tools.rs makes the round trip (call, result, answer) ---

TOOLS_QUESTION = "What is the weather in Paris, and what is 2 + 3?"
TOOL_NAMES = {"get_weather", "add"}


def tool_steps(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The example's JSON lines by step (results as a list), after checking its exit."""
    assert (result.returncode, result.stderr) == (0, ""), result
    steps: dict[str, Any] = {"result": []}
    for line in result.stdout.splitlines():
        step = json.loads(line)
        if step["step"] == "result":
            steps["result"].append(step)
        else:
            assert step["step"] not in steps, result.stdout
            steps[step["step"]] = step
    return steps


def assert_round_trip(steps: dict[str, Any], names: set[str]) -> list[dict[str, Any]]:
    """The calls name offered tools, their arguments validate against that tool's
    parameters, each got its result, and the answer to the results came."""
    parameters = {tool["function"]["name"]: tool["function"]["parameters"]
                  for tool in steps["tools"]["tools"]}
    assert set(parameters) == TOOL_NAMES, steps["tools"]
    call = steps["call"]
    assert call["finish_reason"] == "tool_calls", call
    calls = call["tool_calls"]
    assert calls, call
    for made in calls:
        assert made["id"].startswith("call_") and made["type"] == "function", made
        assert made["function"]["name"] in names, made
        jsonschema.validate(made["function"]["arguments"], parameters[made["function"]["name"]])
    assert [(result["tool_call_id"], result["name"]) for result in steps["result"]] == \
        [(made["id"], made["function"]["name"]) for made in calls], steps
    answer = steps["answer"]
    assert answer["finish_reason"] in ("stop", "length", "tool_calls"), answer
    assert (answer["tool_calls"] is not None) == (answer["finish_reason"] == "tool_calls")
    # The answer may call again (the tools stay offered): those calls hold too.
    for again in answer["tool_calls"] or []:
        assert again["function"]["name"] in TOOL_NAMES, again
        jsonschema.validate(again["function"]["arguments"],
                            parameters[again["function"]["name"]])
    return list(calls)


async def test_tools_example_round_trip_with_calls_that_validate(build: dict[str, Any]) -> None:
    seeds = range(4)
    async with running_daemon() as daemon:
        flags = ["--socket", daemon.socket_path, "--temperature", "1.0", "--max-tokens", "64"]
        # Pipelined by the daemon: the four examples run at once.
        required = await asyncio.gather(*(
            run_async(build["tools"], *flags, "--choice", "required", "--seed", str(seed),
                      TOOLS_QUESTION) for seed in seeds))
        named = await asyncio.gather(*(
            run_async(build["tools"], *flags, "--choice", "add", "--seed", str(seed),
                      TOOLS_QUESTION) for seed in seeds))
    for result in required:
        assert_round_trip(tool_steps(result), TOOL_NAMES)
    for result in named:
        calls = assert_round_trip(tool_steps(result), {"add"})
        assert len(calls) == 1, calls
        # The local function ran on the validated arguments (in 64 bits, as the example adds).
        a, b = calls[0]["function"]["arguments"]["a"], calls[0]["function"]["arguments"]["b"]
        content = tool_steps(result)["result"][0]["content"]
        if all(-2**63 <= n < 2**63 for n in (a, b, a + b)):
            assert content == str(a + b), (a, b, content)
        else:
            assert content.startswith("error:"), (a, b, content)


async def test_tools_example_surfaces_an_unknown_function_and_bad_flags(
        build: dict[str, Any]) -> None:
    async with running_daemon() as daemon:
        unknown = await run_async(build["tools"], "--socket", daemon.socket_path,
                                  "--choice", "multiply", TOOLS_QUESTION)
    # The offered tools come first; then the daemon's refusal naming the field.
    assert unknown.returncode == 1, unknown
    assert [json.loads(line)["step"] for line in unknown.stdout.splitlines()] == ["tools"]
    assert re.fullmatch(r"tools: invalid_request: .*tool_choice.*\n", unknown.stderr), unknown
    usage = await run_async(build["tools"], "--seed", "x", TOOLS_QUESTION)
    assert (usage.returncode, usage.stdout) == (2, ""), usage
    assert "usage" in usage.stderr, usage
