"""The Go client in clients/go (library, unit tests and example program) against the real daemon.

Go runs offline and self-contained: GOPROXY=off, -mod=readonly, GOTOOLCHAIN=local, and a
GOCACHE/GOPATH of the test run's own (the module has no dependencies).
"""

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

MODULE = REPO / "clients" / "go"
BUILD_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 120.0

# Gemma 3 270M continues this in Japanese (3-byte UTF-8 characters, some split across
# tokens); greedy, from an empty cache, so every client gets the same bytes.
PROMPT = "日本の首都は"
OPTIONS: dict[str, Any] = {"max_tokens": 32, "temperature": 0, "seed": 7, "cache_prompt": False}
EXAMPLE_FLAGS = ["-max-tokens", "32", "-temperature", "0", "-seed", "7", "-no-cache-prompt"]


class Go:
    def __init__(self, root: Path) -> None:
        go = shutil.which("go")
        assert go is not None, "Go is not installed (scripts/os-deps.sh installs golang-go)"
        self.go = go
        self.root = root
        self.env = dict(
            os.environ, GOCACHE=str(root / "cache"), GOPATH=str(root / "gopath"),
            GOPROXY="off", GOFLAGS="-mod=readonly", GOTOOLCHAIN="local", GOTELEMETRY="off",
            GOWORK="off")

    def run(self, *args: str, cwd: Path = MODULE) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.go, *args], cwd=cwd, env=self.env, capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, check=False)

    def build(self, package: str, output: Path, cwd: Path = MODULE) -> str:
        result = self.run("build", "-o", str(output), package, cwd=cwd)
        assert result.returncode == 0, result.stdout + result.stderr
        return str(output)


@pytest.fixture(scope="module")
def go(tmp_path_factory: pytest.TempPathFactory) -> Go:
    return Go(tmp_path_factory.mktemp("go"))


@pytest.fixture(scope="module")
def example(go: Go) -> str:
    return go.build("./cmd/sfcore-example", go.root / "sfcore-example")


@pytest.fixture(scope="module")
def structured(go: Go) -> str:
    return go.build("./cmd/sfcore-structured", go.root / "sfcore-structured")


@pytest.fixture(scope="module")
def tools_example(go: Go) -> str:
    return go.build("./cmd/sfcore-tools-example", go.root / "sfcore-tools-example")


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


def test_go_module_is_formatted_vetted_and_unit_tested(go: Go) -> None:
    gofmt = Path(go.run("env", "GOROOT").stdout.strip()) / "bin" / "gofmt"
    formatted = subprocess.run([str(gofmt), "-l", "."], cwd=MODULE, capture_output=True,
                               text=True, timeout=BUILD_TIMEOUT_S, check=False)
    assert (formatted.returncode, formatted.stdout) == (0, ""), formatted.stderr
    vet = go.run("vet", "./...")
    assert vet.returncode == 0, vet.stdout + vet.stderr
    unit = go.run("test", "-count=1", "./...")
    assert unit.returncode == 0, unit.stdout + unit.stderr


@pytest.mark.asyncio
async def test_example_streams_the_python_clients_text(example: str) -> None:
    async with running_daemon() as daemon:
        expected = await reference(daemon.socket_path, PROMPT, **OPTIONS)
        code, out, err = await run(example, "-socket", daemon.socket_path, *EXAMPLE_FLAGS,
                                   PROMPT)
        # The default path comes from $SFCORE_SOCKET.
        env = dict(os.environ, SFCORE_SOCKET=daemon.socket_path)
        env_code, env_out, env_err = await run(example, *EXAMPLE_FLAGS, PROMPT, env=env)
    assert any(ord(char) > 127 for char in expected), expected
    assert (code, err) == (0, "")
    assert out == expected + "\n"
    assert (env_code, env_out, env_err) == (0, expected + "\n", "")


@pytest.mark.asyncio
async def test_example_exits_1_on_an_error_line(example: str) -> None:
    async with running_daemon() as daemon:
        code, out, err = await run(example, "-socket", daemon.socket_path, "-max-tokens", "0",
                                   PROMPT)
    assert code == 1, (out, err)
    assert out == ""
    assert "invalid_request" in err and "max_tokens" in err, err


@pytest.mark.asyncio
async def test_example_exits_3_when_the_daemon_is_unreachable(example: str,
                                                              tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.sock")
    code, out, err = await run(example, "-socket", missing, "Hi")
    assert code == 3, (out, err)
    assert out == ""
    assert missing in err and "may not be running" in err, err
    # A socket file nobody listens on (a daemon that died without removing it).
    stale = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(stale)
        code, out, err = await run(example, "-socket", stale, "Hi")
    assert code == 3, (out, err)
    assert stale in err and "connection refused" in err, err


LIBRARY_GO_MOD = """module sfcorelibtest

go 1.19

require sfcore.local/sfcore v0.0.0

replace sfcore.local/sfcore => %(module)s
"""

LIBRARY_PROGRAM = """package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"sync"

	"sfcore.local/sfcore"
)

func must(err error) {
	if err != nil {
		panic(err)
	}
}

func main() {
	ctx := context.Background()
	out := map[string]any{}
	c, err := sfcore.Dial(ctx, os.Args[1])
	must(err)

	// Concurrent calls share the connection (pipelined, answered in request order).
	var wg sync.WaitGroup
	var tokens, plain []int
	var tokErr, plainErr error
	wg.Add(2)
	go func() { defer wg.Done(); tokens, tokErr = c.Tokenize(ctx, "Hello world", true) }()
	go func() { defer wg.Done(); plain, plainErr = c.Tokenize(ctx, "Hello world", false) }()
	wg.Wait()
	must(tokErr)
	must(plainErr)
	out["tokens"], out["plainTokens"] = tokens, plain
	out["detokenized"], err = c.Detokenize(ctx, plain)
	must(err)
	health, err := c.Health(ctx)
	must(err)
	out["health"] = health.Status
	info, err := c.Info(ctx)
	must(err)
	out["architecture"], out["nCtx"] = info.Model.Architecture, info.Config.NCtx

	greedy := &sfcore.Options{MaxTokens: sfcore.Int(24), Temperature: sfcore.Float(0),
		CachePrompt: sfcore.Bool(false)}
	messages := []sfcore.Message{{Role: "user", Content: "Say hello in French."}}
	out["chat"], err = c.Chat(ctx, messages, greedy)
	must(err)
	var pieces []string
	out["streamedChatResult"], err = c.StreamChat(ctx, messages, greedy, func(p string) error {
		pieces = append(pieces, p)
		return nil
	})
	must(err)
	out["streamedChat"] = strings.Join(pieces, "")

	_, err = c.Generate(ctx, "x", &sfcore.Options{MaxTokens: sfcore.Int(0)})
	var daemonErr *sfcore.Error
	if errors.As(err, &daemonErr) {
		out["error"] = map[string]string{"code": daemonErr.Code, "message": daemonErr.Message}
	}

	// Cancel of a running stream: its reply ends "cancelled", before Cancel returns.
	long := &sfcore.Options{MaxTokens: sfcore.Int(400), Temperature: sfcore.Float(0)}
	prompt := "Count from one to one thousand:"
	stream, err := c.StartGenerate(ctx, prompt, long)
	must(err)
	out["firstPiece"] = stream.Next()
	out["cancelFound"], err = c.Cancel(ctx, stream.ID())
	must(err)
	for stream.Next() {
	}
	must(stream.Err())
	out["cancelled"] = stream.Result()
	out["cancelUnknown"], err = c.Cancel(ctx, 999999)
	must(err)

	// Cancelling the context of a streaming call sends cancel and returns ctx.Err().
	cctx, cancel := context.WithCancel(ctx)
	_, err = c.StreamGenerate(cctx, prompt, long, func(string) error { cancel(); return nil })
	out["contextCancelled"] = errors.Is(err, context.Canceled)
	// An error from the callback stops the stream the same way.
	enough := errors.New("enough")
	_, err = c.StreamGenerate(ctx, prompt, long, func(string) error { return enough })
	out["callbackError"] = errors.Is(err, enough)
	_, err = c.Health(ctx) // answered after both abandoned requests ended
	must(err)
	stats, err := c.Stats(ctx)
	must(err)
	out["stats"] = json.RawMessage(stats.Raw)

	// The prompt store keeps the state of a prompt of min_tokens (256) tokens or more as
	// it is read; a clear forgets it, and the next listing is empty.
	storeLine := "The owl sleeps in the barn and the fox sleeps in the den.\\n"
	storePrompt := strings.Repeat(storeLine, 28)
	_, err = c.Generate(ctx, storePrompt, &sfcore.Options{MaxTokens: sfcore.Int(1)})
	must(err)
	out["storePrompt"] = storePrompt
	out["cacheListed"], err = c.Cache(ctx, false)
	must(err)
	out["cacheCleared"], err = c.Cache(ctx, true)
	must(err)
	out["cacheAfterClear"], err = c.Cache(ctx, false)
	must(err)

	must(c.Close())
	_, err = c.Health(ctx)
	var connErr *sfcore.ConnError
	out["afterClose"] = errors.As(err, &connErr) && errors.Is(err, sfcore.ErrClosed)
	_, err = sfcore.Dial(ctx, os.Args[1]+".missing")
	out["unreachable"] = map[string]any{"connError": errors.As(err, &connErr),
		"message": err.Error()}
	must(json.NewEncoder(os.Stdout).Encode(out))
}
"""

CHAT_MESSAGES = [{"role": "user", "content": "Say hello in French."}]


def python_client_chat_text(path: str, messages: list[dict[str, str]], **options: Any) -> str:
    with sfcore_client.Client(path, timeout=60) as client:
        return client.chat(messages, **options).text


@pytest.mark.asyncio
async def test_library_ops_cancel_and_errors(go: Go, tmp_path: Path) -> None:
    program = tmp_path / "libtest"
    program.mkdir()
    (program / "go.mod").write_text(LIBRARY_GO_MOD % {"module": MODULE})
    (program / "main.go").write_text(LIBRARY_PROGRAM)
    binary = go.build(".", tmp_path / "libtest-bin", cwd=program)
    async with running_daemon() as daemon:
        code, out, err = await run(binary, daemon.socket_path)
        assert code == 0, err
        chat_reference = await asyncio.wait_for(asyncio.to_thread(
            python_client_chat_text, daemon.socket_path, CHAT_MESSAGES,
            max_tokens=24, temperature=0, cache_prompt=False), RUN_TIMEOUT_S)
    result = json.loads(out)

    assert result["health"] == "ok"
    assert result["tokens"][1:] == result["plainTokens"] and len(result["tokens"]) >= 3
    assert result["detokenized"] == "Hello world"
    assert (result["architecture"], result["nCtx"]) == ("gemma3", 4096)

    chat = result["chat"]
    assert chat["Text"] != "" and chat["Text"] == chat_reference
    assert chat["FinishReason"] in ("stop", "length")
    assert chat["Usage"]["completion_tokens"] > 0 and chat["Timings"]["total_ms"] > 0
    assert chat["StopSequence"] == "" and chat["ID"] > 0
    assert result["streamedChat"] == chat["Text"] == result["streamedChatResult"]["Text"]

    assert result["error"]["code"] == "invalid_request"
    assert "max_tokens" in result["error"]["message"]

    assert result["firstPiece"] is True and result["cancelFound"] is True
    assert result["cancelled"]["FinishReason"] == "cancelled"
    assert 0 < result["cancelled"]["Usage"]["completion_tokens"] < 400
    assert result["cancelUnknown"] is False
    assert result["contextCancelled"] is True and result["callbackError"] is True
    requests = result["stats"]["requests"]
    assert requests["by_outcome"]["cancelled"] == 3
    assert requests["by_op"]["cancel"] == 4

    listed, cleared = result["cacheListed"], result["cacheCleared"]
    assert listed["enabled"] is True and listed["removed_states"] == 0, listed
    assert Path(listed["dir"]).parent == daemon.directory / "prompts", listed
    assert listed["states"], listed
    for state in listed["states"]:
        assert state["tokens"] >= 256 and state["bytes"] > 0 and state["ram"] is True, state
        assert state["preview"] and result["storePrompt"].startswith(state["preview"]), state
    assert cleared["enabled"] is True and cleared["states"] == [], cleared
    assert cleared["removed_states"] == len(listed["states"]), cleared
    assert cleared["removed_files"] >= 1 and cleared["removed_bytes"] > 0, cleared
    assert result["cacheAfterClear"]["states"] == [], result["cacheAfterClear"]
    assert result["cacheAfterClear"]["removed_states"] == 0

    assert result["afterClose"] is True
    assert result["unreachable"]["connError"] is True
    assert daemon.socket_path + ".missing" in result["unreachable"]["message"]


# --- structured output: sfcore-structured asks for a document by JSON Schema ---

STRUCTURED_FLAGS = ["-temperature", "0", "-no-cache-prompt"]


@pytest.mark.asyncio
async def test_structured_example_prints_a_document_of_the_schema(structured: str,
                                                                   tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    async with running_daemon(REPRODUCIBLE) as daemon:
        flags = ["-socket", daemon.socket_path, *STRUCTURED_FLAGS, "-max-tokens", "200"]
        generated = await run(structured, *flags, "-json-schema", str(schema), PERSON_PROMPT)
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_client_document, daemon.socket_path, PERSON_PROMPT), RUN_TIMEOUT_S)
        chatted = await run(structured, *flags, "-chat", "-json-schema", str(schema),
                            "Describe a person.")
        anything = await run(structured, *flags, "-format", "json", PERSON_PROMPT)
        answer = await run(structured, "-socket", daemon.socket_path, *STRUCTURED_FLAGS,
                           "-max-tokens", "8", "-grammar", str(grammar),
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
        structured: str, tmp_path: Path) -> None:
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps({"type": "number", "minimum": 3}))
    person = tmp_path / "person.json"
    person.write_text(json.dumps(PERSON_SCHEMA))
    async with running_daemon() as daemon:
        bad = await run(structured, "-socket", daemon.socket_path, "-json-schema",
                        str(refused), "Hi")
        both = await run(structured, "-socket", daemon.socket_path, "-json-schema",
                         str(person), "-format", "json", "Hi")
    # "code: message" is what the example prints for an *sfcore.Error (other errors print
    # their Error(), which starts "sfcore: ").
    code, out, err = bad
    assert (code, out) == (1, ""), bad
    assert re.fullmatch(r"sfcore-structured: invalid_request: .*minimum.*\n", err), err
    code, out, err = both
    assert (code, out) == (1, ""), both
    assert re.fullmatch(r"sfcore-structured: invalid_request: .*exclude each other.*\n",
                        err), err


# --- logprobs and metrics ---

LOGPROBS_PROGRAM = """package main

import (
	"context"
	"encoding/json"
	"os"

	"sfcore.local/sfcore"
)

func must(err error) {
	if err != nil {
		panic(err)
	}
}

type top struct {
	Token   int
	Text    string
	Bytes   []int
	Logprob float64
}

type entry struct {
	top
	TopLogprobs []top
}

func ints(b []byte) []int {
	out := make([]int, len(b))
	for i, c := range b {
		out[i] = int(c)
	}
	return out
}

// plain: the Result's text, completion tokens, the entries' bytes joined, and the entries
// with their bytes as lists of ints.
func plain(res *sfcore.Result) map[string]any {
	var joined []byte
	entries := []entry{}
	for _, e := range res.Logprobs {
		joined = append(joined, e.Bytes...)
		tops := []top{}
		for _, t := range e.TopLogprobs {
			tops = append(tops, top{t.Token, t.Text, ints(t.Bytes), t.Logprob})
		}
		entries = append(entries, entry{top{e.Token, e.Text, ints(e.Bytes), e.Logprob}, tops})
	}
	return map[string]any{"text": res.Text, "completionTokens": res.Usage.CompletionTokens,
		"joined": string(joined), "entries": entries, "nil": res.Logprobs == nil}
}

func main() {
	ctx := context.Background()
	c, err := sfcore.Dial(ctx, os.Args[1])
	must(err)
	greedy := &sfcore.Options{MaxTokens: sfcore.Int(16), Temperature: sfcore.Float(0),
		Seed: sfcore.Int64(7), CachePrompt: sfcore.Bool(false), Logprobs: sfcore.Int(3)}
	out := map[string]any{}
	whole, err := c.Generate(ctx, os.Args[2], greedy)
	must(err)
	out["whole"] = plain(whole)
	streamed, err := c.StreamGenerate(ctx, os.Args[2], greedy, func(string) error { return nil })
	must(err)
	out["streamed"] = plain(streamed)
	without, err := c.Generate(ctx, os.Args[2], &sfcore.Options{MaxTokens: sfcore.Int(2)})
	must(err)
	out["withoutNil"] = without.Logprobs == nil
	out["metrics"], err = c.Metrics(ctx)
	must(err)
	must(c.Close())
	must(json.NewEncoder(os.Stdout).Encode(out))
}
"""


@pytest.mark.asyncio
async def test_library_logprobs_and_metrics(go: Go, tmp_path: Path) -> None:
    program = tmp_path / "logprobs"
    program.mkdir()
    (program / "go.mod").write_text(LIBRARY_GO_MOD % {"module": MODULE})
    (program / "main.go").write_text(LOGPROBS_PROGRAM)
    binary = go.build(".", tmp_path / "logprobs-bin", cwd=program)
    async with running_daemon() as daemon:
        code, out, err = await run(binary, daemon.socket_path, PROMPT)
        assert code == 0, err
        expected = await asyncio.wait_for(asyncio.to_thread(
            python_logprobs, daemon.socket_path, PROMPT), RUN_TIMEOUT_S)
    result = json.loads(out)

    for reply in (result["whole"], result["streamed"]):
        entries = reply["entries"]
        # Greedy, no stop sequence: one entry per completion token, whose bytes are the text.
        assert reply["nil"] is False
        assert len(entries) == reply["completionTokens"] > 0
        assert reply["joined"] == reply["text"]
        for entry in entries:
            tops = entry.pop("TopLogprobs")
            assert entry["Logprob"] <= 0 and len(tops) == 3, entry
            assert tops[0] == entry, (entry, tops)
            assert [top["Logprob"] for top in tops] == sorted(
                (top["Logprob"] for top in tops), reverse=True), tops
        assert [(entry["Token"], entry["Logprob"]) for entry in entries] == expected
    assert result["streamed"]["text"] == result["whole"]["text"]
    assert any(ord(char) > 127 for char in result["whole"]["text"])
    assert result["withoutNil"] is True
    assert_generated_counted(result["metrics"], 2 * len(expected))


# --- tool calls: sfcore-tools-example offers two functions, runs the calls, sends results ---


@pytest.mark.asyncio
async def test_tools_example_round_trip_calls_validate(tools_example: str) -> None:
    flags = [flag.replace("--", "-") for flag in TOOL_FLAGS]
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        base = [tools_example, "-socket", daemon.socket_path, *flags]
        required = await asyncio.gather(*(
            run(*base, "-seed", str(seed), "-tool-choice", "required") for seed in TOOL_SEEDS))
        named = await asyncio.gather(*(
            run(*base, "-seed", str(seed), "-tool-choice", "add") for seed in range(2)))
        single = await run(*base, "-seed", "9", "-tool-choice", "required", "-no-parallel")
        refused = await run(tools_example, "-socket", daemon.socket_path, "-max-tokens", "0")
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
    assert re.fullmatch(r"sfcore-tools-example: invalid_request: .*max_tokens.*\n", err), err
