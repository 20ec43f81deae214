"""Helpers shared by the fault, property, start-up fault and soak tests.

They drive the real daemon (tests/harness.py) and add what those tests need on top:
blocking raw sockets (a client that writes without reading, or reads whatever
arrives before a reset), the daemon's memory and file descriptors from /proc, a
daemon run to its exit with stderr and its sd_notify messages captured apart, and
a daemon kept on a private event loop thread for synchronous (hypothesis) tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tomli_w

from tests.harness import REPO, Daemon, done_of, running_daemon

T = TypeVar("T")

_PROGRESS_RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO) ")

# Every reply type that ends a request (PROTOCOL.md: `done`, `error`, or an op's own reply).
FINAL_TYPES = frozenset({"done", "error", "health", "tokens", "text", "info", "stats",
                         "cancelled", "cache", "metrics"})
ERROR_CODES = frozenset({"bad_json", "invalid_request", "context_overflow", "queue_full",
                         "line_too_long", "too_many_connections", "forbidden",
                         "shutting_down", "internal"})


# --- the daemon's process ------------------------------------------------------------------


def proc_status_kb(pid: int, key: str) -> int:
    """A `kB` figure of /proc/<pid>/status, such as VmRSS or RssAnon."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def rss_anon_mb(pid: int) -> float:
    return proc_status_kb(pid, "RssAnon") / 1024


def vm_rss_mb(pid: int) -> float:
    return proc_status_kb(pid, "VmRSS") / 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> dict[str, int]:
    """What the open descriptors point at ("socket:[...]" shortened to "socket"), counted."""
    targets: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        target = target.split(":[")[0] if ":[" in target else target
        targets[target] = targets.get(target, 0) + 1
    return targets


# --- waiting -------------------------------------------------------------------------------


async def poll_until(probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], *,
                     timeout: float, interval: float = 0.02, what: str = "condition") -> T:
    """Call `probe` until `accept(result)`, at most `timeout` seconds. For states that
    no event reports (the slot became idle, a request was queued)."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await probe()
        if accept(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s; last: {last!r}")
        await asyncio.sleep(interval)


async def health(daemon: Daemon, timeout: float = 30.0) -> dict[str, Any]:
    async with daemon.client() as client:
        return await client.final({"op": "health"}, timeout)


async def assert_serves(daemon: Daemon) -> None:
    """The daemon is alive and answers a NEW connection: health, then a 2-token generate."""
    assert daemon.process.returncode is None, f"daemon exited; log:\n{daemon.log}"
    async with daemon.client() as client:
        reply = await client.final({"op": "health", "id": "alive?"}, timeout=30)
        assert reply["type"] == "health" and reply["id"] == "alive?", reply
        assert reply["status"] == "ok", reply
        done = done_of(await client.request(
            {"id": "alive-gen", "prompt": "Hello", "max_tokens": 2}, timeout=60))
        assert done["id"] == "alive-gen"
        assert done["usage"]["completion_tokens"] == 2, done


# --- raw sockets ---------------------------------------------------------------------------


@dataclass
class RawResult:
    data: bytes
    ended: str  # "eof", "reset" or "timeout": how the daemon's side of the stream ended
    send_error: str | None  # why sending stopped early (the daemon closed), if it did
    sent: int  # bytes accepted by the kernel

    def lines(self) -> list[dict[str, Any]]:
        return parse_reply_lines(self.data)


def parse_reply_lines(data: bytes) -> list[dict[str, Any]]:
    """Every reply line: one JSON object with `id` and `type`, each ended by a newline."""
    assert not data or data.endswith(b"\n"), f"partial last line: {data[-200:]!r}"
    replies = []
    for raw in data.splitlines():
        reply = json.loads(raw)
        assert isinstance(reply, dict), raw[:200]
        assert "id" in reply and "type" in reply, reply
        assert isinstance(reply["id"], str | int) and not isinstance(reply["id"], bool), reply
        replies.append(reply)
    return replies


def connect_raw(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def read_to_end(sock: socket.socket, limit: int = 1 << 30) -> tuple[bytes, str]:
    """Everything the peer sends until it closes. A reset (the daemon closed with our
    unread bytes in its buffer) still delivers what arrived before it."""
    received = bytearray()
    while len(received) < limit:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(received), "reset"
        except TimeoutError:
            return bytes(received), "timeout"
        if not chunk:
            return bytes(received), "eof"
        received += chunk
    return bytes(received), "limit"


def raw_exchange(path: str, chunks: Iterable[bytes], *, pace_s: float = 0.0,
                 half_close: bool = False, timeout: float = 60.0) -> RawResult:
    """Send `chunks` (blocking, one write each) while a thread reads until the daemon
    closes; returns what was read. Run it with asyncio.to_thread."""
    sock = connect_raw(path, timeout)
    result: dict[str, Any] = {}

    def receive() -> None:
        result["data"], result["ended"] = read_to_end(sock)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    send_error = None
    sent = 0
    try:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError) as exc:
                send_error = type(exc).__name__
                break
            except TimeoutError:
                send_error = "send timed out (the daemon stopped reading)"
                break
            sent += len(chunk)
            if pace_s:
                time.sleep(pace_s)
        if half_close and send_error is None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        receiver.join(timeout + 5)
        assert not receiver.is_alive(), "reader thread did not finish"
    finally:
        sock.close()
    return RawResult(result["data"], result["ended"], send_error, sent)


# --- a daemon run to its exit --------------------------------------------------------------


@dataclass
class Exited:
    code: int
    stdout: str
    stderr: str
    notifications: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def stderr_lines(self) -> list[str]:
        """Non-blank stderr lines, except the daemon's INFO/DEBUG progress log records
        (such as "listening on ...; loading the model"), which are not complaints."""
        return [line for line in self.stderr.splitlines()
                if line.strip() and not _PROGRESS_RECORD.match(line)]

    def describe(self) -> str:
        return (f"exit {self.code} after {self.seconds:.2f} s; notifications "
                f"{self.notifications}; stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sf", dir="/tmp"))  # sun_path holds 108 bytes


class NotifyListener:
    """A NOTIFY_SOCKET for a daemon started outside the harness."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "n")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode(errors="replace"))
            except BlockingIOError:
                return self.messages

    async def wait_for(self, prefix: str, process: asyncio.subprocess.Process,
                       timeout: float) -> bool:
        """Wait for a message starting with `prefix`; False if the process exits first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            self.drain()
            if any(m.startswith(prefix) for m in self.messages):
                return True
            if process.returncode is not None:
                return False
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(f"no {prefix!r} within {timeout} s: {self.messages}")
            receive = asyncio.ensure_future(loop.sock_recv(self.sock, 4096))
            exited = asyncio.ensure_future(process.wait())
            done, _ = await asyncio.wait({receive, exited}, timeout=remaining,
                                         return_when=asyncio.FIRST_COMPLETED)
            exited.cancel()
            if receive in done:
                self.messages.append(receive.result().decode(errors="replace"))
            else:
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receive

    def close(self) -> None:
        self.sock.close()


async def spawn_daemon(args: Iterable[str], directory: Path, *,
                       config: dict[str, Any] | None = None,
                       env: dict[str, str] | None = None,
                       ) -> tuple[asyncio.subprocess.Process, NotifyListener]:
    """Start `sfcore-daemon ARGS` (stdout and stderr piped apart) with a NOTIFY_SOCKET."""
    notify = NotifyListener(directory)
    extra: list[str] = []
    if config is not None:
        config_path = directory / "c.toml"
        config_path.write_text(tomli_w.dumps(config))
        extra = ["--config", str(config_path)]
    daemon_env = dict(os.environ, NOTIFY_SOCKET=notify.path, PYTHONUNBUFFERED="1")
    for name, value in (env or {}).items():
        if value:
            daemon_env[name] = value
        else:
            daemon_env.pop(name, None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfcore_daemon", *extra, *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=daemon_env, cwd=str(REPO))
    return process, notify


async def reap(process: asyncio.subprocess.Process, notify: NotifyListener,
               directory: Path) -> None:
    """Kill the daemon if it still runs, and remove what spawn_daemon set up."""
    if process.returncode is None:
        process.kill()
        await process.wait()
    notify.close()
    shutil.rmtree(directory, ignore_errors=True)


async def collect_exit(process: asyncio.subprocess.Process, notify: NotifyListener,
                       started: float, timeout: float) -> Exited:
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return Exited(process.returncode, stdout.decode(errors="replace"),
                  stderr.decode(errors="replace"), list(notify.drain()),
                  time.monotonic() - started)


async def run_to_exit(args: Iterable[str], *, config: dict[str, Any] | None = None,
                      env: dict[str, str] | None = None, timeout: float = 60.0,
                      directory: Path | None = None) -> Exited:
    """Run the daemon until it exits on its own (a start-up error)."""
    directory = directory or short_dir()
    try:
        started = time.monotonic()
        process, notify = await spawn_daemon(args, directory, config=config, env=env)
        try:
            return await collect_exit(process, notify, started, timeout)
        finally:
            notify.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def assert_one_clear_line(result: Exited, *must_contain: str) -> str:
    """A start-up failure: non-zero exit, no READY=1, no traceback, and exactly one
    line on stderr (the reason, naming what is wrong) besides INFO progress records."""
    assert result.code != 0, result.describe()
    assert "Traceback" not in result.output, result.describe()
    assert not any(m.startswith("READY=1") for m in result.notifications), result.describe()
    lines = result.stderr_lines()
    assert len(lines) == 1, f"expected one line on stderr; {result.describe()}"
    line = lines[0]
    for text in must_contain:
        assert text in line, (text, result.describe())
    return line


# --- a daemon on a background event loop (for synchronous tests) ---------------------------


class BackgroundDaemon:
    """`running_daemon` on a private event loop in a thread, so that a synchronous test
    (hypothesis) can talk to one daemon with blocking sockets for its whole run:
    `with BackgroundDaemon(config) as background: background.daemon.socket_path`."""

    def __init__(self, config: dict[str, Any] | None = None, start_timeout: float = 150.0):
        self._config = config
        self._timeout = start_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._context: Any = None
        self._daemon: Daemon | None = None

    @property
    def daemon(self) -> Daemon:
        assert self._daemon is not None
        return self._daemon

    def run(self, coroutine: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the daemon's loop (e.g. `assert_serves(daemon)`)."""
        future = asyncio.run_coroutine_threadsafe(_as_coroutine(coroutine), self._loop)
        return future.result(self._timeout if timeout is None else timeout)

    def __enter__(self) -> BackgroundDaemon:
        self._thread.start()
        self._context = running_daemon(self._config)
        try:
            self._daemon = self.run(self._context.__aenter__())
        except BaseException:
            self._close_loop()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.run(self._context.__aexit__(*exc_info))
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self._loop.close()


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable
