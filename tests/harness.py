"""Run the real daemon on a real socket in a temp dir, and talk NDJSON to it.

Readiness is the daemon's own systemd notification (READY=1 on a NOTIFY_SOCKET
the harness listens on), so no test polls or sleeps to learn the daemon is up.
Every wait is bounded: a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 120.0  # the first start on a new machine assembles the 250 MB model
REPLY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0

# Small and quick by default; tests override what they exercise.
BASE_CONFIG: dict[str, Any] = {
    "model": {"n_ctx": 4096},
    "generation": {"max_tokens": 16},
    "log": {"level": "info"},
    # Every draft the matching proposes: with "measured" (the default) whether a draft
    # is made depends on step costs measured at start-up, and tests that need drafts
    # (byte equality, counts) must get them on a loaded machine too. The gate has its
    # own tests (tests/test_draftgate.py). No store of earlier answers: with one, a
    # request sent again drafts from its first answer, and tests that compare a repeated
    # request's bytes (cold against warm) would compare other batch shapes; the store
    # has its own tests (tests/test_speculative.py).
    "speculative": {"policy": "always", "store_tokens": 0},
    # All n_threads on a loaded machine too: the thread count partitions llama.cpp's sums,
    # and many tests compare bytes (cold against warm, before and after a restart). The
    # adaptation has its own tests (tests/test_adaptive_threads.py).
    "runtime": {"adaptive_threads": False},
}

# The single or last line of a reply: everything but a streamed `token`.
FINAL_TYPES = frozenset({"done", "error", "health", "info", "stats", "tokens", "text", "cancelled",
                         "cache", "metrics"})


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for section, values in extra.items():
        merged.setdefault(section, {}).update(values)
    return merged


class Client:
    """One NDJSON connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, *messages: dict[str, Any] | bytes) -> None:
        """Send messages in one write (so several requests arrive pipelined)."""
        data = b"".join(
            m if isinstance(m, bytes) else json.dumps(m).encode() + b"\n" for m in messages
        )
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any] | None:
        """The next reply line, or None at EOF."""
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            return None
        assert line.endswith(b"\n"), line
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def reply(self, timeout: float = REPLY_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every line of the next request's reply (up to its final line)."""
        lines = []
        while True:
            line = await self.recv(timeout)
            assert line is not None, f"connection closed mid-reply after {lines}"
            lines.append(line)
            if line["type"] in FINAL_TYPES:
                return lines

    async def request(self, message: dict[str, Any] | bytes,
                      timeout: float = REPLY_TIMEOUT_S) -> list[dict[str, Any]]:
        await self.send(message)
        return await self.reply(timeout)

    async def final(self, message: dict[str, Any] | bytes,
                    timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        return (await self.request(message, timeout))[-1]

    async def start_streaming(self, *messages: dict[str, Any]) -> dict[str, Any]:
        """Send (pipelined) requests and return once the first has streamed a token:
        from then on the slot is known to be busy with it."""
        await self.send(*messages)
        first = await self.recv()
        assert first is not None and first["type"] == "token", first
        return first

    async def expect_eof(self, timeout: float = REPLY_TIMEOUT_S) -> None:
        rest = await asyncio.wait_for(self.reader.read(), timeout)
        assert rest == b"", rest

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(self.writer.wait_closed(), REPLY_TIMEOUT_S)


@dataclass
class Daemon:
    process: asyncio.subprocess.Process
    socket_path: str
    log_path: Path
    directory: Path
    notifications: list[str] = field(default_factory=list)
    _notify_sock: socket.socket | None = None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def log_with(self, text: str, timeout: float = REPLY_TIMEOUT_S) -> str:
        """The log once it holds `text`. A line logged while serving reaches the file
        from the daemon's log thread a little after the reply that followed it; the
        startup lines are all written by READY=1, and all lines by the daemon's exit."""
        deadline = asyncio.get_running_loop().time() + timeout
        while text not in (log := self.log):
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{text!r} not logged within {timeout} s; log:\n{log}")
            await asyncio.sleep(0.01)
        return log

    async def connect(self) -> Client:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(self.socket_path, limit=1 << 24), REPLY_TIMEOUT_S)
        return Client(reader, writer)

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Client]:
        client = await self.connect()
        try:
            yield client
        finally:
            await client.close()

    async def notification(self, prefix: str, timeout: float = READY_TIMEOUT_S) -> str:
        """Wait for the daemon's next sd_notify message starting with `prefix`."""
        assert self._notify_sock is not None
        loop = asyncio.get_running_loop()
        while True:
            waiter = asyncio.ensure_future(loop.sock_recv(self._notify_sock, 4096))
            exited = asyncio.ensure_future(self.process.wait())
            done, _ = await asyncio.wait({waiter, exited}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiter not in done:
                waiter.cancel()
                exited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                state = "exited" if exited in done else "timed out"
                raise AssertionError(f"daemon {state} before {prefix!r}; log:\n{self.log}")
            exited.cancel()
            message = waiter.result().decode()
            self.notifications.append(message)
            if message.startswith(prefix):
                return message

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.signal(signal.SIGTERM)
        return await self.wait_exit()


@contextlib.asynccontextmanager
async def running_daemon(
    config: dict[str, Any] | None = None,
    *,
    args: Iterable[str] = (),
    socket_path: str | None = None,
    wait_ready: bool = True,
    expect_clean_exit: bool = True,
    env: dict[str, str] | None = None,
) -> AsyncIterator[Daemon]:
    """Start a daemon on a short temp socket path, wait for READY=1, stop it afterwards.

    With wait_ready=False it yields as soon as the socket accepts (model still loading).
    `env` adds to (or, with a value of "", removes from) the daemon's environment.

    On leaving, the daemon is sent SIGTERM and must exit 0 and remove its socket.
    """
    directory = Path(tempfile.mkdtemp(prefix="sf", dir="/tmp"))  # sun_path holds 108 bytes
    notify_path = directory / "n"
    notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_sock.bind(str(notify_path))
    notify_sock.setblocking(False)
    config_path = directory / "c.toml"
    merged = merge(BASE_CONFIG, config or {})
    # Each daemon its own prompt store, unless a test shares one (a restart): states
    # another test left behind would turn its cold requests into restored ones.
    merged.setdefault("cache", {}).setdefault("dir", str(directory / "prompts"))
    config_path.write_text(tomli_w.dumps(merged))
    socket_path = socket_path or str(directory / "d.sock")
    log_path = directory / "daemon.log"
    daemon_env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONUNBUFFERED="1")
    for name, value in (env or {}).items():
        if value:
            daemon_env[name] = value
        else:
            daemon_env.pop(name, None)
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sfcore_daemon", "--config", str(config_path),
            "--socket", socket_path, *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file, env=daemon_env,
            cwd=str(REPO),
        )
    daemon = Daemon(process, socket_path, log_path, directory, _notify_sock=notify_sock)
    try:
        await daemon.notification("READY=1" if wait_ready else "STATUS=loading")
        yield daemon
        code = await daemon.stop()
        if expect_clean_exit:
            assert code == 0, f"daemon exited {code}; log:\n{daemon.log}"
            assert not os.path.exists(socket_path), "socket file left behind"
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        notify_sock.close()
        shutil.rmtree(directory, ignore_errors=True)


async def run_cli(*args: str, timeout: float = READY_TIMEOUT_S,
                  env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `sfcore-daemon ARGS` to completion (for startup errors); returns (code, output)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfcore_daemon", *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, cwd=str(REPO), env=env,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, output.decode(errors="replace")


def tokens_text(lines: list[dict[str, Any]]) -> str:
    return "".join(line["text"] for line in lines if line["type"] == "token")


def done_of(lines: list[dict[str, Any]]) -> dict[str, Any]:
    assert lines[-1]["type"] == "done", lines[-1]
    return lines[-1]
