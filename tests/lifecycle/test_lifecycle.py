"""Startup, the socket file, CPU pinning and shutdown of the real daemon."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import stat
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.kit import done_of, run_cli, running_daemon
from tests.kit.faults import poll_until

pytestmark = pytest.mark.asyncio


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sf", dir="/tmp"))


# --- the socket file ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["0600", "0660"])
async def test_socket_is_created_with_the_configured_mode(mode: str) -> None:
    async with running_daemon({"server": {"socket_mode": mode}}) as daemon:
        info = os.lstat(daemon.socket_path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == int(mode, 8)


async def test_second_daemon_on_a_live_socket_refuses_to_start() -> None:
    async with running_daemon() as daemon:
        code, output = await run_cli("--socket", daemon.socket_path)
        assert code == 1
        assert "already listening" in output and daemon.socket_path in output
        assert "Traceback" not in output
        async with daemon.client() as client:  # the first one is untouched
            assert (await client.final({"op": "health"}))["status"] == "ok"


async def test_stale_socket_is_reclaimed() -> None:
    path = short_dir() / "d.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(path))  # a socket file nobody listens on: what a crash leaves
    leftover.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    async with running_daemon(socket_path=str(path)) as daemon:
        async with daemon.client() as client:
            assert (await client.final({"op": "health"}))["status"] == "ok"
        assert await daemon.stop() == 0  # logging is asynchronous: read it once stopped
        assert "removing stale socket" in daemon.log


async def test_a_path_that_is_not_a_socket_is_refused_and_kept() -> None:
    directory = short_dir()
    path = directory / "precious.txt"
    path.write_text("do not delete")
    code, output = await run_cli("--socket", str(path))
    assert code == 1
    assert "not a socket" in output and str(path) in output
    assert path.read_text() == "do not delete"


# --- startup errors ------------------------------------------------------------------------


async def test_missing_model_file_is_one_clear_line() -> None:
    directory = short_dir()
    missing = directory / "nope.gguf"
    code, output = await run_cli("--socket", str(directory / "s"), "--model", str(missing))
    assert code == 1
    assert str(missing) in output and "not found" in output
    assert "Traceback" not in output
    assert not (directory / "s").exists()


async def test_corrupt_model_file_is_refused_and_the_socket_removed() -> None:
    directory = short_dir()
    corrupt = directory / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    code, output = await run_cli("--socket", str(directory / "s"), "--model", str(corrupt))
    assert code == 1
    assert f"cannot load model {corrupt}" in output
    assert "Traceback" not in output
    assert not (directory / "s").exists()


async def test_nonexistent_cpu_is_a_startup_error() -> None:
    directory = short_dir()
    config = directory / "c.toml"
    config.write_text("[runtime]\ncpu_affinity = [0, 4096]\n")
    code, output = await run_cli("--config", str(config), "--socket", str(directory / "s"))
    assert code == 1
    assert "4096" in output and "does not exist" in output
    assert "Traceback" not in output


async def test_daemon_pins_itself_and_derives_threads_from_the_pinned_set() -> None:
    async with running_daemon({"runtime": {"cpu_affinity": [0]}}) as daemon:
        process = psutil.Process(daemon.process.pid)
        assert process.cpu_affinity() == [0]
        # Every thread, not just the main one: affinity is per thread on Linux.
        assert {t.id: os.sched_getaffinity(t.id) for t in process.threads()} == {
            t.id: {0} for t in process.threads()}
        async with daemon.client() as client:
            done = done_of(await client.request({"prompt": "Hi", "max_tokens": 3}))
            assert done["usage"]["completion_tokens"] == 3
        assert await daemon.stop() == 0  # logging is asynchronous: read it once stopped
        assert "threads=1 threads_batch=1 cpus=[0]" in daemon.log
        assert "llama.cpp system info:" in daemon.log


# --- shutdown ------------------------------------------------------------------------------


async def test_sigterm_drains_the_running_request_and_rejects_queued_ones() -> None:
    async with running_daemon({"server": {"drain_timeout_s": 60, "slots": 1}}) as daemon:
        async with daemon.client() as runner, daemon.client() as waiter, \
                daemon.client() as watcher:
            # Its grammar never completes: it runs to exactly max_tokens, seconds longer
            # than the signal takes to arrive.
            await runner.start_streaming(
                {"id": "running", "prompt": "Tell a story.", "max_tokens": 200,
                 "grammar": "root ::= [a-z ] root"})
            await waiter.send({"id": "queued", "prompt": "Hello", "max_tokens": 4})
            # Another connection: the daemon may read it before the waiter's line.
            await poll_until(lambda: watcher.final({"op": "health"}),
                             lambda h: h["queue_depth"] == 1, timeout=30,
                             what="the second request queued")
            daemon.signal(signal.SIGTERM)
            assert await daemon.notification("STOPPING=1", timeout=30)
            queued = (await waiter.reply(timeout=30))[-1]
            assert queued["id"] == "queued" and queued["code"] == "shutting_down"
            await waiter.expect_eof()
            # The running request finishes in full.
            done = done_of(await runner.reply())
            assert done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 200
            await runner.expect_eof()
        assert await daemon.wait_exit() == 0
        assert not os.path.exists(daemon.socket_path)


async def test_drain_timeout_cancels_the_running_request() -> None:
    async with running_daemon({"server": {"drain_timeout_s": 0.5}}) as daemon:
        async with daemon.client() as runner, daemon.client() as watcher:
            await runner.start_streaming(
                {"id": "long", "prompt": "Tell a story.", "max_tokens": 2000})
            daemon.signal(signal.SIGTERM)
            done = done_of(await runner.reply(timeout=30))
            assert done["finish_reason"] == "cancelled"
            assert done["usage"]["completion_tokens"] < 2000
            await watcher.expect_eof()
        assert await daemon.wait_exit() == 0


async def test_health_says_draining_and_new_work_is_refused_during_shutdown() -> None:
    async with running_daemon({"server": {"drain_timeout_s": 60}}) as daemon:
        async with daemon.client() as runner:
            await runner.start_streaming(
                {"id": "long", "prompt": "Tell a story.", "max_tokens": 200})
            daemon.signal(signal.SIGTERM)
            assert await daemon.notification("STOPPING=1", timeout=30)
            # Pipelined behind the running request on the same connection.
            await runner.send({"id": "h", "op": "health"}, {"id": "g", "prompt": "Hi"})
            assert done_of(await runner.reply())["id"] == "long"
            health = (await runner.reply())[-1]
            assert health["type"] == "health" and health["status"] == "draining"
            refused = (await runner.reply())[-1]
            assert refused["id"] == "g" and refused["code"] == "shutting_down"
            await runner.expect_eof()
        # Nothing listens any more.
        with pytest.raises(OSError):
            await asyncio.open_unix_connection(daemon.socket_path)


async def test_second_signal_cancels_at_once() -> None:
    async with running_daemon({"server": {"drain_timeout_s": 600}}) as daemon:
        async with daemon.client() as runner:
            await runner.start_streaming({"prompt": "Tell a story.", "max_tokens": 2000})
            daemon.signal(signal.SIGINT)
            assert await daemon.notification("STOPPING=1", timeout=30)
            daemon.signal(signal.SIGINT)
            done = done_of(await runner.reply(timeout=30))
            assert done["finish_reason"] == "cancelled"
        assert await daemon.wait_exit() == 0
