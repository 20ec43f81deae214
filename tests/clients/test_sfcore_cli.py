"""The `sfcore` command (clients/python, sfcore_client.cli) as a user runs it.

Run as a subprocess against the real daemon: generate streams as tokens arrive, reads
its prompt from stdin, prints raw NDJSON with --json, exits 0/1/2/3 and never with a
traceback; Ctrl-C cancels. `sfcore chat` runs on a pseudo-terminal (pty.fork, every
read bounded by select): turns reuse the cache, Ctrl-C stops an answer and the session
goes on, Ctrl-C at the prompt drops the line, /reset, /exit and Ctrl-D.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sfcore_client import Client

from tests.kit import REPO, running_daemon

SFCORE = [sys.executable, "-m", "sfcore_client"]
RUN_TIMEOUT_S = 120
GREEDY = ("--temperature", "0", "--no-cache")
FIGURES = (r"\[(?P<tokens>\d+) tokens, [\d.]+ tok/s, cached (?P<cached>\d+)/(?P<prompt>\d+) "
           r"prompt tokens, first token \d+ ms, (?P<reason>\w+)\]")


def sfcore(*args: str, stdin: str | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*SFCORE, *args], input=stdin, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, cwd=REPO, env={**os.environ, **(env or {})},
                            check=False, stdin=None if stdin is not None else subprocess.DEVNULL)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def stopped_and_free(path: str) -> None:
    """The slot is free and the request left behind ended as cancelled, well before
    its token budget. Polls health on a separate connection (there is no event for
    it), bounded."""
    deadline = time.monotonic() + 60
    with Client(path, timeout=10) as monitor:
        while monitor.health()["busy"]:
            assert time.monotonic() < deadline, "the slot is still busy"
            time.sleep(0.01)
        stats = monitor.stats()
    assert stats["requests"]["by_outcome"]["cancelled"] >= 1, stats["requests"]
    assert stats["requests"]["by_outcome"]["length"] == 0, stats["requests"]


def in_thread(function: Any, *args: Any, timeout: float = 300) -> Any:
    return asyncio.wait_for(asyncio.to_thread(function, *args), timeout)


# --- generate and the one-shot commands ---

def generate_session(path: str) -> None:
    # Streams: the first text arrives while the command is still generating.
    process = subprocess.Popen([*SFCORE, "generate", "--socket", path, "--max-tokens", "300",
                                "Write a very long story about a lighthouse keeper."],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "no output within 60 s"
        assert os.read(process.stdout.fileno(), 65536)
        assert process.poll() is None, "the command ended before streaming was seen"
        process.communicate(timeout=RUN_TIMEOUT_S)
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            process.wait()

    plain = sfcore("generate", "--socket", path, "--max-tokens", "8", *GREEDY, "Count: 1, 2, 3,")
    assert plain.returncode == 0 and plain.stdout.strip() and plain.stderr == ""
    # The prompt from stdin (one trailing newline dropped), and $SFCORE_SOCKET.
    piped = sfcore("generate", "--max-tokens", "8", *GREEDY, stdin="Count: 1, 2, 3,\n",
                   env={"SFCORE_SOCKET": path})
    dash = sfcore("generate", "--socket", path, "--max-tokens", "8", *GREEDY, "-",
                  stdin="Count: 1, 2, 3,")
    assert piped.stdout == dash.stdout == plain.stdout

    raw = sfcore("generate", "--socket", path, "--json", "--max-tokens", "8", *GREEDY,
                 "Count: 1, 2, 3,")
    lines = [json.loads(line) for line in raw.stdout.splitlines()]
    assert [line["type"] for line in lines] == ["token"] * 8 + ["done"]
    assert len({line["id"] for line in lines}) == 1
    assert lines[-1]["usage"]["completion_tokens"] == 8 and lines[-1]["finish_reason"] == "length"
    assert "".join(line["text"] for line in lines) + "\n" == plain.stdout

    verbose = sfcore("generate", "--socket", path, "-v", "--max-tokens", "4", "Hi")
    assert re.fullmatch(FIGURES + "\n", verbose.stderr), verbose.stderr

    stopped = sfcore("generate", "--socket", path, "--max-tokens", "16", *GREEDY,
                     "--stop", " 6", "--stop", "never", "Count: 1, 2, 3,")
    assert stopped.stdout == " 4, 5,\n"


@pytest.mark.asyncio
async def test_generate_streams_reads_stdin_and_prints_raw_lines() -> None:
    async with running_daemon() as daemon:
        await in_thread(generate_session, daemon.socket_path)


def ops_session(path: str) -> None:
    health = sfcore("health", "--socket", path)
    assert health.returncode == 0
    assert re.search(r"^status: ok$", health.stdout, re.M)
    assert re.search(r"^busy: no$", health.stdout, re.M)
    health_json = json.loads(sfcore("health", "--socket", path, "--json").stdout)
    assert health_json["type"] == "health" and health_json["busy"] is False
    info = sfcore("info", "--socket", path)
    assert re.search(r"^  architecture: gemma3$", info.stdout, re.M), info.stdout
    assert json.loads(sfcore("info", "--socket", path, "--json").stdout)["config"]["n_ctx"] == 4096
    stats = sfcore("stats", "--socket", path)
    assert re.search(r"^requests:$", stats.stdout, re.M)
    assert re.search(r"^    health: 2$", stats.stdout, re.M), stats.stdout
    assert json.loads(sfcore("stats", "--socket", path, "--json").stdout)["type"] == "stats"

    tokens = sfcore("tokenize", "--socket", path, "Hello world").stdout.split()
    assert tokens[0] == "2" and len(tokens) == 3
    assert json.loads(sfcore("tokenize", "--socket", path, "--json", "--no-special",
                             "Hello").stdout) == [9259]
    assert sfcore("tokenize", "--socket", path, "-", stdin="Hello world\n").stdout.split() \
        == tokens
    assert sfcore("detokenize", "--socket", path, *tokens).stdout == "Hello world\n"
    assert json.loads(sfcore("detokenize", "--socket", path, "--json", "9259").stdout) == "Hello"

    # 1: an error line from the daemon, on stderr as `sfcore: <code>: <message>`.
    bad = sfcore("generate", "--socket", path, "--max-tokens", "0", "Hi")
    assert bad.returncode == 1 and bad.stdout == ""
    assert re.fullmatch(r"sfcore: invalid_request: .*max_tokens.*\n", bad.stderr), bad.stderr
    bad_raw = sfcore("generate", "--socket", path, "--json", "--top-p", "0", "Hi")
    assert bad_raw.returncode == 1
    assert json.loads(bad_raw.stdout)["code"] == "invalid_request"
    assert sfcore("detokenize", "--socket", path, "-5").returncode == 1


@pytest.mark.asyncio
async def test_ops_for_people_and_machines_and_daemon_errors_exit_1() -> None:
    async with running_daemon() as daemon:
        await in_thread(ops_session, daemon.socket_path)


def test_usage_mistakes_exit_2_and_an_unreachable_daemon_exits_3(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    for args, stdin in ((["generate", "--socket", missing, "--max-tokens", "many", "Hi"], None),
                        (["generate", "--socket", missing, "--system", "be nice", "Hi"], None),
                        (["generate", "--socket", missing], ""),
                        (["generate", "--socket", missing, "--timeout", "0", "Hi"], None),
                        (["detokenize", "--socket", missing, "one"], None),
                        (["bogus"], None), ([], None)):
        result = sfcore(*args, stdin=stdin)
        assert result.returncode == 2, (args, result)
        assert result.stderr.strip() and result.stdout == ""
    for command in (["health"], ["generate", "Hi"], ["chat"]):
        gone = sfcore(*command, "--socket", missing, stdin="Hello\n")
        assert gone.returncode == 3, gone
        assert gone.stderr.count("\n") == 1
        assert missing in gone.stderr and "may not be running" in gone.stderr
    env_gone = sfcore("health", env={"SFCORE_SOCKET": missing})
    assert env_gone.returncode == 3 and missing in env_gone.stderr


# --- structured output: what a pipe hands to jq ---

PERSON_SCHEMA = {"type": "object",
                 "properties": {"name": {"type": "string", "maxLength": 24},
                                "age": {"type": "integer"}, "alive": {"type": "boolean"}},
                 "required": ["name", "age", "alive"]}
PERSON_PROMPT = ('JSON records, one per line.\n'
                 'Example: {"name": "Ada Lovelace", "age": 36, "alive": false}\n'
                 'Example: {"name": "Linus", "age": 54, "alive": true}\nExample: ')


def structured_session(path: str, tmp_path: Path) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON_SCHEMA))
    person = sfcore("generate", "--socket", path, "--max-tokens", "200", *GREEDY,
                    "--json-schema", str(schema), PERSON_PROMPT)
    assert person.returncode == 0, person
    document = json.loads(person.stdout)  # all of stdout, as `| jq` reads it
    assert set(document) == {"name", "age", "alive"}, document
    assert isinstance(document["age"], int) and isinstance(document["alive"], bool)
    # The library takes the same fields by their protocol names.
    with Client(path, timeout=RUN_TIMEOUT_S) as client:
        result = client.generate(PERSON_PROMPT, json_schema=PERSON_SCHEMA, max_tokens=200,
                                 temperature=0, cache_prompt=False)
    assert result.finish_reason == "stop" and json.loads(result.text) == document
    # The schema on stdin, the prompt as an argument.
    piped = sfcore("generate", "--socket", path, "--max-tokens", "200", *GREEDY,
                   "--json-schema", "-", PERSON_PROMPT, stdin=json.dumps(PERSON_SCHEMA))
    assert piped.stdout == person.stdout
    anything = sfcore("generate", "--socket", path, "--max-tokens", "200", *GREEDY,
                      "--format", "json", PERSON_PROMPT)
    assert anything.returncode == 0, anything
    assert isinstance(json.loads(anything.stdout), dict)
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= "yes" | "no"\n')
    answer = sfcore("generate", "--socket", path, "--max-tokens", "8", *GREEDY,
                    "--grammar", str(grammar), "Is the sky blue? Answer:")
    assert answer.returncode == 0 and answer.stdout in ("yes\n", "no\n"), answer
    # The same through chat.
    chat = sfcore("chat", "--socket", path, "--max-tokens", "200", *GREEDY,
                  "--json-schema", str(schema), stdin="Describe a person.\n")
    assert chat.returncode == 0, chat
    assert set(json.loads(chat.stdout)) == {"name", "age", "alive"}, chat.stdout
    # A schema the daemon refuses is its error, exit 1, naming the keyword.
    schema.write_text(json.dumps({"type": "number", "minimum": 3}))
    refused = sfcore("generate", "--socket", path, "--json-schema", str(schema), "Hi")
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert re.fullmatch(r"sfcore: invalid_request: .*minimum.*\n", refused.stderr), refused


@pytest.mark.asyncio
async def test_structured_output_flags_print_what_a_pipe_hands_to_jq(tmp_path: Path) -> None:
    async with running_daemon() as daemon:
        await in_thread(structured_session, daemon.socket_path, tmp_path)


def test_structured_output_flag_mistakes_exit_2_before_connecting(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")  # never reached: each mistake is found first
    not_json = tmp_path / "schema.json"
    not_json.write_text("{type: object}")
    not_utf8 = tmp_path / "grammar.gbnf"
    not_utf8.write_bytes(b"root ::= \"\xff\"")
    for args, stdin, words in (
            (["--json-schema", str(tmp_path / "absent.json"), "Hi"], None, "absent.json"),
            (["--json-schema", str(not_json), "Hi"], None, "not JSON"),
            (["--grammar", str(not_utf8), "Hi"], None, "not UTF-8"),
            (["--json-schema", str(not_json), "--format", "json", "Hi"], None, "not allowed"),
            (["--format", "yaml", "Hi"], None, "invalid choice"),
            (["--grammar", "-"], "root ::= \"a\"", "give the prompt as an argument")):
        result = sfcore("generate", "--socket", missing, *args, stdin=stdin)
        assert result.returncode == 2, (args, result)
        assert words in result.stderr and result.stdout == "", (args, result)
    chat = sfcore("chat", "--socket", missing, "--json-schema", "-", stdin="{}")
    assert chat.returncode == 2 and "as a file" in chat.stderr, chat


def test_the_console_script_is_installed() -> None:
    script = REPO / ".venv" / "bin" / "sfcore"
    assert script.exists(), "scripts/bootstrap.sh installs clients/python into .venv"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, check=False)
    assert result.returncode == 0 and "generate" in result.stdout and "chat" in result.stdout


def interrupt_generate(path: str) -> None:
    process = subprocess.Popen([*SFCORE, "generate", "--socket", path, "--max-tokens", "2000",
                                "Write a very long story about a lighthouse keeper."],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, cwd=REPO)
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready, "no output within 60 s"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 130 and err.decode() == "sfcore: cancelled\n"
    finally:
        if process.returncode is None:
            process.kill()
            process.wait()
    stopped_and_free(path)


@pytest.mark.asyncio
async def test_ctrl_c_cancels_a_generation() -> None:
    async with running_daemon() as daemon:
        await in_thread(interrupt_generate, daemon.socket_path)
        stats = await in_thread(_stats, daemon.socket_path)
        assert stats["requests"]["by_op"]["cancel"] == 1
        assert stats["requests"]["by_outcome"]["cancelled"] == 1


def _stats(path: str) -> dict[str, Any]:
    with Client(path, timeout=10) as client:
        return client.stats()


# --- chat ---

def pipe_chat(path: str) -> None:
    result = sfcore("chat", "--socket", path, "--max-tokens", "6", "--temperature", "0",
                    "--system", "Answer briefly.",
                    stdin="Hello there.\nAnd how are you?\n\n/reset\nHello there.\n/exit\n"
                          "Not sent\n")
    assert result.returncode == 0, result
    figures = [match.groupdict() for match in re.finditer(FIGURES, result.stderr)]
    assert len(figures) == 3 and "(conversation cleared)" in result.stderr
    first, second, third = (int(f["prompt"]) for f in figures)
    assert second > first and int(figures[1]["cached"]) >= first  # turn 2 reuses turn 1
    assert third == first  # after /reset: the first turn again
    assert "\x1b[" not in result.stderr  # no colour when stderr is not a terminal


@pytest.mark.asyncio
async def test_chat_reads_one_message_per_line_from_a_pipe() -> None:
    async with running_daemon() as daemon:
        await in_thread(pipe_chat, daemon.socket_path)


class Terminal:
    """`sfcore chat` on a pseudo-terminal; every read bounded."""

    def __init__(self, path: str, *options: str, color: bool = False) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes sfcore on the terminal
            # A shell gives its foreground job Ctrl-C; a suite started as a background
            # job of a non-interactive shell ignores SIGINT, and an ignored signal stays
            # ignored across exec (Python then installs no KeyboardInterrupt handler).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            os.environ["TERM"] = "dumb"
            if color:
                os.environ.pop("NO_COLOR", None)
            else:
                os.environ["NO_COLOR"] = "1"
            os.execv(sys.executable, [*SFCORE, "chat", "--socket", path, *options])
        self.screen = ""
        self.seen = ""

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.screen)
            if match:
                self.seen += self.screen[:match.end()]
                self.screen = self.screen[match.end():]
                return match
            remaining = deadline - time.monotonic()
            assert remaining > 0, (f"no {pattern!r} on the terminal; it shows {self.screen!r} "
                                   f"after {self.seen[-300:]!r}")
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    raise AssertionError(f"terminal closed before {pattern!r}: {self.screen!r}")
                self.screen += data.decode(errors="replace")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def interrupt_at_prompt(self) -> None:
        """Ctrl-C at the prompt: "^C", then a new prompt.

        CPython's readline checks for signals only when its select() on the terminal is
        interrupted: a SIGINT that lands while it is still handling the last key is
        noticed only at the next key. So the key goes only once the process is blocked
        in select() with every typed key handled (the kernel shows where it waits)."""
        self.wait_blocked_in_select()
        self.send("\x03")
        self.expect(r"\^C")
        self.expect("> ")

    def wait_blocked_in_select(self, timeout: float = 30.0) -> None:
        """Until the terminal's process sleeps in select()/poll(): no event reports
        that, so its kernel wait channel is polled, bounded."""
        deadline = time.monotonic() + timeout
        while True:
            with open(f"/proc/{self.pid}/wchan") as wchan:
                where = wchan.read()
            if "poll" in where or "select" in where:
                return
            assert time.monotonic() < deadline, f"sfcore chat never waited for a key ({where!r})"
            time.sleep(0.005)

    def ask(self, message: str) -> re.Match[str]:
        """Send a message at the prompt; the figures line after its answer."""
        self.send(message + "\n")
        figures = self.expect(FIGURES)
        self.expect("> ")
        return figures

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)  # no event for a child's exit without SIGCHLD handling
        self.kill()
        raise AssertionError("sfcore chat did not exit")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass

    def close(self) -> None:
        self.kill()
        os.close(self.fd)


def repl_turns(path: str) -> list[dict[str, str]]:
    terminal = Terminal(path, "--max-tokens", "24", "--temperature", "0", color=True)
    try:
        terminal.expect("Ctrl-C stops an answer")
        terminal.expect("> ")
        figures = [terminal.ask(message).groupdict()
                   for message in ("Tell me about Paris.", "And Rome?", "And Berlin?")]
        assert "\x1b[2m[" in terminal.seen  # dim: a terminal, and NO_COLOR unset
        # Ctrl-C at the prompt drops the line typed so far: "garbage/reset" is not sent.
        terminal.send("garbage")
        terminal.expect("garbage")
        terminal.interrupt_at_prompt()
        terminal.send("/reset\n")
        terminal.expect(r"\(conversation cleared\)")
        terminal.expect("> ")
        figures.append(terminal.ask("Tell me about Paris.").groupdict())
        terminal.send("/exit\n")
        assert terminal.wait() == 0
    finally:
        terminal.close()
    return figures


@pytest.mark.asyncio
async def test_chat_turns_reuse_the_cache_and_reset_starts_over() -> None:
    async with running_daemon() as daemon:
        figures = await in_thread(repl_turns, daemon.socket_path)
    prompts = [int(f["prompt"]) for f in figures]
    cached = [int(f["cached"]) for f in figures]
    # Turns 2 and 3 report the previous turn's prompt (and answer) as cached.
    assert cached[1] >= prompts[0] and cached[2] >= prompts[1], figures
    assert cached[2] / prompts[2] > 0.8
    assert prompts[0] < prompts[1] < prompts[2]
    assert prompts[3] == prompts[0]  # after /reset: the first turn again


def repl_error(path: str) -> None:
    terminal = Terminal(path, "--top-p", "0")  # every turn is invalid_request
    try:
        terminal.expect("> ")
        for _ in range(2):
            terminal.send("Hi\n")
            terminal.expect(r"sfcore: invalid_request: .*top_p")
            terminal.expect("> ")  # the session goes on
        terminal.send("/exit\n")
        assert terminal.wait() == 0
    finally:
        terminal.close()


@pytest.mark.asyncio
async def test_an_error_at_the_terminal_ends_the_turn_not_the_session() -> None:
    async with running_daemon() as daemon:
        await in_thread(repl_error, daemon.socket_path)


def repl_interrupt(path: str) -> tuple[dict[str, str], dict[str, str], str]:
    terminal = Terminal(path, "--max-tokens", "400", "--temperature", "0")
    try:
        terminal.expect("> ")
        answers = []
        for message in ("Write a very long story about a dragon.", "Go on."):
            terminal.send(message + "\n")
            terminal.expect(re.escape(message) + r"\r?\n")  # the terminal's echo
            terminal.expect(r"\S")  # the answer has begun
            terminal.send("\x03")
            terminal.expect(r"\[cancelled\]")
            answers.append(terminal.expect(FIGURES).groupdict())
            terminal.expect("> ")
            stopped_and_free(path)
        terminal.send("\x04")  # Ctrl-D leaves
        assert terminal.wait() == 0
    finally:
        terminal.close()
    return answers[0], answers[1], terminal.seen


@pytest.mark.asyncio
async def test_ctrl_c_stops_an_answer_and_the_session_goes_on() -> None:
    async with running_daemon() as daemon:
        first, second, seen = await in_thread(repl_interrupt, daemon.socket_path)
    assert first["reason"] == second["reason"] == "cancelled"
    assert 1 <= int(first["tokens"]) < 400 and int(second["tokens"]) < 400
    # The stopped answer stayed in the history (its tokens are in turn 2's prompt), and
    # the cache still held it.
    assert int(second["prompt"]) > int(first["prompt"]) + int(first["tokens"])
    assert int(second["cached"]) >= int(first["prompt"])
    assert "\x1b[" not in seen  # NO_COLOR
