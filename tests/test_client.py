"""The Python client distribution (clients/python) and `sfcore` against the real daemon."""

from __future__ import annotations

import asyncio
import gc
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

import pytest
from sfcore_client import AsyncClient, Client, SfcoreConnectionError, SfcoreError

from tests.harness import REPO, running_daemon

SFCORE = [sys.executable, "-m", "sfcore_client.cli"]
LONG = "Write a very long story about a lighthouse keeper."


def slot_free_within(path: str, seconds: float) -> bool:
    """Poll health (there is no event for 'the slot became free') for a bounded time."""
    deadline = time.monotonic() + seconds
    with Client(path, timeout=10) as monitor:
        while time.monotonic() < deadline:
            if not monitor.health()["busy"]:
                return True
            time.sleep(0.02)
    return False


def blocking_session(path: str) -> None:
    with Client(path, timeout=60) as client:
        streamed = client.stream_generate("Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                          cache_prompt=False)
        pieces = list(streamed)
        whole = client.generate("Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                cache_prompt=False)
        assert streamed.result is not None and "".join(pieces) == whole.text != ""
        assert whole.finish_reason == "length" and whole.usage.completion_tokens == 8
        reply = client.chat([{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage.prompt_tokens > 5 and reply.timings.first_token_ms > 0
        assert client.detokenize(client.tokenize("媽 🤗")) == "媽 🤗"
        assert client.info()["model"]["architecture"] == "gemma3"
        assert client.stats()["requests"]["by_op"]["chat"] == 1
        assert client.cancel("nothing-pending") is False
        with pytest.raises(SfcoreError) as error:
            client.generate("x", max_tokens=0)
        assert error.value.code == "invalid_request" and "max_tokens" in error.value.message
        assert client.health()["status"] == "ok"  # the connection survived the error


@pytest.mark.asyncio
async def test_blocking_client_every_op_and_errors() -> None:
    async with running_daemon() as daemon:
        await asyncio.wait_for(asyncio.to_thread(blocking_session, daemon.socket_path), 120)


def leave_early(path: str, how: str) -> None:
    with Client(path, timeout=60) as client:
        stream = client.stream_generate(LONG, max_tokens=2000)
        if how == "break":
            for _ in stream:
                break
        elif how == "exception":
            with pytest.raises(RuntimeError):
                for _ in stream:
                    raise RuntimeError("the caller's own bug")
        else:  # garbage collection of a half-read stream
            iterator = iter(stream)
            next(iterator)
            del iterator, stream
            gc.collect()
        assert slot_free_within(path, 1.0)
        # The same client goes on working (reconnecting if it had to close).
        assert client.generate("Hi", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["break", "exception", "garbage"])
async def test_leaving_a_stream_early_frees_the_slot_within_a_second(how: str) -> None:
    async with running_daemon() as daemon:
        await asyncio.wait_for(asyncio.to_thread(leave_early, daemon.socket_path, how), 120)


@pytest.mark.asyncio
async def test_async_client_streams_cancels_and_raises() -> None:
    async with running_daemon() as daemon:
        async with AsyncClient(daemon.socket_path, timeout=60) as client:
            stream = client.stream_chat([{"role": "user", "content": "Hi"}], max_tokens=6,
                                        temperature=0, cache_prompt=False)
            pieces = [piece async for piece in stream]
            whole = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=6,
                                      temperature=0, cache_prompt=False)
            assert stream.result is not None and "".join(pieces) == whole.text
            assert await client.tokenize("a", add_special=False) == [236746]
            long_stream = client.stream_generate(LONG, max_tokens=2000)
            async for _ in long_stream:
                break
            assert await asyncio.to_thread(slot_free_within, daemon.socket_path, 1.0)
            with pytest.raises(SfcoreError) as error:
                await client.detokenize([-1])
            assert error.value.code == "invalid_request"
            assert (await client.health())["status"] == "ok"


def test_unreachable_daemon_names_the_path_and_env_is_honoured(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    with pytest.raises(SfcoreConnectionError) as error:
        Client(missing).health()
    assert missing in str(error.value) and "running" in str(error.value)
    assert isinstance(error.value, ConnectionError)
    os.environ["SFCORE_SOCKET"] = missing
    try:
        assert Client().socket_path == missing
    finally:
        del os.environ["SFCORE_SOCKET"]
    assert Client().socket_path == "/tmp/sfcore-ai.sock"


def run_sfcore(*args: str, stdin: str | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SFCORE, *args], input=stdin, capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={**os.environ, **(env or {})},
                          check=False)


def cli_session(path: str) -> None:
    out = run_sfcore("generate", "--socket", path, "--max-tokens", "6", "--temperature", "0",
                     "Count: 1, 2, 3,")
    assert out.returncode == 0 and out.stdout.strip(), out
    piped = run_sfcore("generate", "--max-tokens", "6", "--temperature", "0",
                       stdin="Count: 1, 2, 3,", env={"SFCORE_SOCKET": path})
    assert piped.stdout == out.stdout
    raw = run_sfcore("generate", "--socket", path, "--json", "--max-tokens", "3", "Hi")
    lines = [json.loads(line) for line in raw.stdout.splitlines()]
    assert lines[-1]["type"] == "done" and lines[-1]["usage"]["completion_tokens"] == 3
    assert all(line["type"] == "token" for line in lines[:-1])
    bad = run_sfcore("generate", "--socket", path, "--max-tokens", "0", "Hi")
    assert bad.returncode == 1 and "invalid_request" in bad.stderr
    assert "Traceback" not in bad.stderr
    usage = run_sfcore("generate", "--socket", path, "--max-tokens", "many", "Hi")
    assert usage.returncode == 2
    gone = run_sfcore("health", "--socket", path + ".missing")
    assert gone.returncode == 3 and path + ".missing" in gone.stderr
    health = run_sfcore("health", "--socket", path)
    assert health.returncode == 0 and "status: ok" in health.stdout
    stats = json.loads(run_sfcore("stats", "--socket", path, "--json").stdout)
    assert stats["type"] == "stats"
    tokens = run_sfcore("tokenize", "--socket", path, "Hello").stdout.split()
    assert tokens[0] == "2"
    text = run_sfcore("detokenize", "--socket", path, *tokens).stdout
    assert text == "Hello\n"


@pytest.mark.asyncio
async def test_sfcore_command_streams_pipes_and_uses_exit_codes() -> None:
    async with running_daemon() as daemon:
        await asyncio.wait_for(asyncio.to_thread(cli_session, daemon.socket_path), 240)


class Terminal:
    """`sfcore chat` on a pseudo-terminal; every read bounded."""

    def __init__(self, path: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: becomes sfcore chat on the terminal
            os.environ["NO_COLOR"] = "1"
            os.execv(sys.executable, [*SFCORE, "chat", "--socket", path, "--max-tokens",
                                      "24", "--temperature", "0"])
        self.screen = ""

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.screen)
            if match:
                self.screen = self.screen[match.end():]
                return match
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {pattern!r} on the terminal; it shows {self.screen!r}"
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if ready:
                try:
                    self.screen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"terminal closed before {pattern!r}") from None

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError("sfcore chat did not exit")


FIGURES = r"\[(\d+) tokens, [\d.]+ tok/s, cached (\d+)/(\d+) prompt tokens, first token (\d+) ms"


def repl_session(path: str) -> list[tuple[int, int, int]]:
    terminal = Terminal(path)
    figures = []
    try:
        terminal.expect("> ")
        for message in ("Tell me about Paris.", "And Rome?", "And Berlin?"):
            terminal.send(message + "\n")
            match = terminal.expect(FIGURES)
            figures.append((int(match[2]), int(match[3]), int(match[4])))
            terminal.expect("> ")
        # Ctrl-C while an answer is being written cancels it and keeps the session.
        terminal.send("Write a very long story about a dragon.\n")
        terminal.expect(r"\S")  # the answer has begun
        terminal.send("\x03")
        terminal.expect(r"\[cancelled\]")
        terminal.expect(r"cancelled\]")  # the figures line of the cancelled turn
        terminal.expect("> ")
        assert slot_free_within(path, 1.0)
        terminal.send("/reset\n")
        terminal.expect("conversation cleared")
        terminal.expect("> ")
        terminal.send("Hi\n")
        match = terminal.expect(FIGURES)
        assert int(match[3]) < figures[0][1] + 10  # a fresh, short conversation again
        terminal.expect("> ")
        terminal.send("\x04")  # Ctrl-D leaves
        assert terminal.wait() == 0
    finally:
        os.close(terminal.fd)
    return figures


@pytest.mark.asyncio
async def test_sfcore_chat_repl_on_a_terminal() -> None:
    async with running_daemon() as daemon:
        figures = await asyncio.wait_for(asyncio.to_thread(repl_session, daemon.socket_path),
                                         240)
    (_, prompt1, _), (cached2, prompt2, _), (cached3, prompt3, _) = figures
    # Turns 2 and 3 reuse what the previous turn left in the cache.
    assert cached2 >= prompt1 and cached3 >= prompt2
    assert cached3 / prompt3 > 0.8


def test_sfcore_chat_exit_command_leaves(tmp_path: Path) -> None:
    # /exit needs no daemon: nothing is sent before the first message.
    out = run_sfcore("chat", "--socket", str(tmp_path / "none.sock"), stdin="/exit\n")
    assert out.returncode == 0, out
