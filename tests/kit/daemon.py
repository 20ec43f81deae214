"""The daemon launcher: the real daemon on a real socket in a short temp dir.

`running_daemon` starts one, waits for its READY=1 and stops it afterwards (it must exit
0 and remove its socket); `Daemon.client()` talks NDJSON to it (tests/kit/ndjson.py).
`start_daemon` is the same start without the context (the benches, scripts/benchkit,
stop and close it themselves): it can write the log to a file of the caller's, start
from another checkout (`tree`, to compare two) and leave the tests' BASE_CONFIG out;
every daemon records its spawn-to-ready time (`Daemon.ready_ms`).
`run_cli` and `run_to_exit` run it to its own exit (start-up errors); `BackgroundDaemon`
keeps one on a private event loop thread for synchronous (hypothesis) tests.

Readiness is the daemon's own systemd notification (READY=1 on a NOTIFY_SOCKET
the kit listens on), so no test polls or sleeps to learn the daemon is up.
Every wait is bounded: a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tests.kit.ndjson import REPLY_TIMEOUT_S, Client

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0  # the first start on a new machine assembles the 250 MB model
STOP_TIMEOUT_S = 60.0
_PROGRESS_RECORD = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO) ")

# Small and quick by default; tests override what they exercise.
BASE_CONFIG: dict[str, Any] = {
    # Flash attention for every step: the choice measured at start-up costs seconds with a
    # new cache folder; it has its own tests (tests/e2e/ndjson/test_matmul_attention.py).
    "model": {"n_ctx": 4096, "matmul_attention": "off"},
    "generation": {"max_tokens": 16},
    "log": {"level": "info"},
    # Every draft the matching proposes: with "measured" (the default) whether a draft
    # is made depends on step costs measured at start-up, and tests that need drafts
    # (byte equality, counts) must get them on a loaded machine too. The gate has its
    # own tests (tests/unit/engine/test_draftgate.py). No store of earlier answers: with one, a
    # request sent again drafts from its first answer, and tests that compare a repeated
    # request's bytes (cold against warm) would compare other batch shapes; the store
    # has its own tests (tests/e2e/ndjson/test_speculative.py).
    "speculative": {"policy": "always", "store_tokens": 0},
    # A fixed count of prompt rows beside streams: with 0 (the default) every start with a
    # new cache folder measures step costs, seconds each; the measured share has its own
    # test (tests/e2e/ndjson/test_slots.py).
    "server": {"prefill_per_step": 64},
    # All n_threads on a loaded machine too: the thread count partitions llama.cpp's sums,
    # and many tests compare bytes (cold against warm, before and after a restart). The
    # adaptation has its own tests (tests/e2e/ndjson/test_adaptive_threads.py).
    "runtime": {"adaptive_threads": False},
}

def _toml(config: dict[str, Any]) -> str:
    import tomli_w  # only where a daemon is started: the client side needs no TOML writer

    return tomli_w.dumps(config)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s sections merged in, key by key (a new dict; neither changes)."""
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for section, values in extra.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = dict(values) if isinstance(values, dict) else values
    return merged


class NoNotification(AssertionError):
    """The daemon exited (`code`), or the wait timed out (`code` None), before the
    notification waited for; `log` is its log."""

    def __init__(self, message: str, code: int | None, log: str) -> None:
        super().__init__(message)
        self.code, self.log = code, log


@dataclass
class Daemon:
    process: asyncio.subprocess.Process
    socket_path: str
    log_path: Path
    directory: Path
    notifications: list[str] = field(default_factory=list)
    # Milliseconds from the spawn to the notification start_daemon waited for (READY=1),
    # and that notification (its STATUS= names the HTTP listener's address, if any).
    ready_ms: float = 0.0
    ready_message: str = ""
    tree: Path = REPO  # the checkout it runs from
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
        return await Client.open(self.socket_path)

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
                log = self.log
                raise NoNotification(f"daemon {state} before {prefix!r}; log:\n{log}",
                                     self.process.returncode, log)
            exited.cancel()
            message = waiter.result().decode()
            self.notifications.append(message)
            if message.startswith(prefix):
                return message

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        return await asyncio.wait_for(self.process.wait(), timeout)

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (unless it has exited) and its exit code."""
        if self.process.returncode is None:
            self.signal(signal.SIGTERM)
        return await self.wait_exit(timeout)

    async def close(self) -> None:
        """Kill it if it still runs; remove its temp directory (a log file of the
        caller's, start_daemon's `log_path`, stays)."""
        try:
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        finally:
            if self._notify_sock is not None:
                self._notify_sock.close()
            shutil.rmtree(self.directory, ignore_errors=True)


async def start_daemon(
    config: dict[str, Any] | None = None,
    *,
    base: dict[str, Any] | None = BASE_CONFIG,
    args: Iterable[str] = (),
    socket_path: str | None = None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    append_log: bool = False,
    tree: Path | str | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
) -> Daemon:
    """Start a daemon on a short temp socket path and wait for its READY=1.

    `config` is merged over `base` (the tests' BASE_CONFIG; None for the daemon's own
    defaults), and the prompt store is one of its own in the temp dir unless `config`
    names one. With wait_ready=False it returns once the socket accepts (STATUS=loading,
    the model still loading). `env` adds to (or, with a value of "", removes from) the
    daemon's environment. Its stdout and stderr go to `log_path` (appended to with
    `append_log`), by default daemon.log in the temp dir. `tree`: the checkout whose
    sfcore_daemon runs (its working directory; this interpreter), by default this one.
    NoNotification (an AssertionError, with the exit code and the log) if it exits or
    `ready_timeout` passes first; nothing is left running then.

    The caller stops it (`stop`, the exit code) and then `close`s it.
    """
    directory = Path(tempfile.mkdtemp(prefix="sf", dir="/tmp"))  # sun_path holds 108 bytes
    config_path = directory / "c.toml"
    merged = merge(base or {}, config or {})
    # Each daemon its own prompt store, unless a test shares one (a restart): states
    # another test left behind would turn its cold requests into restored ones.
    merged.setdefault("cache", {}).setdefault("dir", str(directory / "prompts"))
    try:
        # Before the socket: a config TOML cannot hold fails here and leaks nothing.
        config_path.write_text(_toml(merged))
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    notify_path = directory / "n"
    notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_sock.bind(str(notify_path))
    notify_sock.setblocking(False)
    socket_path = socket_path or str(directory / "d.sock")
    log_path = log_path or directory / "daemon.log"
    tree = Path(tree).resolve() if tree is not None else REPO
    daemon_env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), PYTHONUNBUFFERED="1",
                      SFCORE_CHECK_THREADS=os.environ.get("SFCORE_CHECK_THREADS", "1"))
    for name, value in (env or {}).items():
        if value:
            daemon_env[name] = value
        else:
            daemon_env.pop(name, None)
    try:
        with log_path.open("ab" if append_log else "wb") as log_file:
            started = time.perf_counter()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sfcore_daemon", "--config", str(config_path),
                "--socket", socket_path, *args,
                stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                env=daemon_env, cwd=str(tree),
            )
    except BaseException:
        notify_sock.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    daemon = Daemon(process, socket_path, log_path, directory, tree=tree,
                    _notify_sock=notify_sock)
    try:
        daemon.ready_message = await daemon.notification(
            "READY=1" if wait_ready else "STATUS=loading", ready_timeout)
        daemon.ready_ms = (time.perf_counter() - started) * 1e3
    except BaseException:
        await daemon.close()
        raise
    return daemon


@contextlib.asynccontextmanager
async def running_daemon(
    config: dict[str, Any] | None = None,
    *,
    args: Iterable[str] = (),
    socket_path: str | None = None,
    wait_ready: bool = True,
    expect_clean_exit: bool = True,
    env: dict[str, str] | None = None,
    base: dict[str, Any] | None = BASE_CONFIG,
    log_path: Path | None = None,
    append_log: bool = False,
    tree: Path | str | None = None,
) -> AsyncIterator[Daemon]:
    """`start_daemon` (its arguments), stopped on leaving: the daemon is sent SIGTERM and
    must exit 0 and remove its socket (unless expect_clean_exit=False)."""
    daemon = await start_daemon(config, base=base, args=args, socket_path=socket_path,
                                wait_ready=wait_ready, env=env, log_path=log_path,
                                append_log=append_log, tree=tree)
    try:
        yield daemon
        code = await daemon.stop()
        if expect_clean_exit:
            assert code == 0, f"daemon exited {code}; log:\n{daemon.log}"
            assert not os.path.exists(daemon.socket_path), "socket file left behind"
    finally:
        await daemon.close()


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
    """A NOTIFY_SOCKET for a daemon started outside `running_daemon`."""

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
        config_path.write_text(_toml(config))
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
