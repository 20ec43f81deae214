"""The Python client library (clients/python, package sfcore_client).

Against the real daemon: every op with both clients, errors, streams, and that leaving a
stream early (break, an exception, dropping it, garbage collection, task cancellation)
stops the request and frees the daemon's slot. Against a scripted fake daemon (no model):
the wire cases the real one seldom produces: very long lines, replies out of step,
closing error codes, silence (timeouts), a hang-up mid-stream. And the distribution
itself: a wheel with no dependency, py.typed and the `sfcore` entry point.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sfcore_client import (
    AsyncClient,
    Client,
    QueuePosition,
    Result,
    SfcoreConnectionError,
    SfcoreError,
    SfcoreTimeoutError,
    ToolCall,
    assistant_message,
    function_tool,
    tool_message,
)
from sfcore_client._common import chat_messages, generation_request, result_of

from tests.kit import REPO, running_daemon

LONG = "Write a very long story about a lighthouse keeper."
GREEDY: dict[str, Any] = {"temperature": 0, "cache_prompt": False}
SLOT_FREE_TIMEOUT_S = 60.0
# A hang bound, not a speed limit, for a reply line that comes only after hundreds of
# tokens: beside a CPU-heavy process the model runs at a few tokens a second.
LONG_REPLY_TIMEOUT_S = 240.0


def slot_freed(path: str) -> dict[str, Any]:
    """Wait until `health` on a separate connection says no slot is busy; the `stats`
    then. (Polling: the daemon has no event for it; the whole wait is bounded.)"""
    deadline = time.monotonic() + SLOT_FREE_TIMEOUT_S
    with Client(path, timeout=10) as monitor:
        while monitor.health()["busy"]:
            assert time.monotonic() < deadline, "the slot is still busy"
            time.sleep(0.01)
        return monitor.stats()


def assert_stopped_early(stats: dict[str, Any], cancelled_before: int) -> None:
    """The request left behind ended as cancelled, long before its 2000 tokens."""
    assert stats["requests"]["by_outcome"]["cancelled"] == cancelled_before + 1, stats
    assert stats["tokens"]["generated"] < 1000, stats["tokens"]


def wait_until_read(path: str, count: int) -> None:
    """Until the daemon has read `count` generate requests (bounded polling, on one
    connection of its own)."""
    deadline = time.monotonic() + 30
    with Client(path, timeout=10) as monitor:
        while monitor.stats()["requests"]["by_op"]["generate"] < count:
            assert time.monotonic() < deadline, f"fewer than {count} generate requests read"
            time.sleep(0.01)


def counters(path: str) -> tuple[int, int]:
    """(connections opened so far, cancel requests so far), from a separate connection."""
    with Client(path, timeout=10) as monitor:
        stats = monitor.stats()
    return stats["connections"]["total"], stats["requests"]["by_op"]["cancel"]


def in_thread(function: Callable[..., Any], *args: Any, timeout: float = 180) -> Any:
    """Run blocking client code off the event loop that runs the daemon harness."""
    return asyncio.wait_for(asyncio.to_thread(function, *args), timeout)


# --- the blocking client against the daemon ---

def blocking_ops(path: str) -> None:
    with Client(socket_path=path, timeout=60) as client:
        assert client.socket_path == path
        health = client.health()
        assert (health["type"], health["status"], health["busy"]) == ("health", "ok", False)

        whole = client.generate("Count: 1, 2, 3,", max_tokens=8, **GREEDY)
        assert isinstance(whole, Result) and isinstance(whole.id, int)
        assert whole.finish_reason == "length" and whole.stop_sequence is None
        assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 5
        assert whole.timings.first_token_ms > 0 and whole.timings.decode_tok_s > 0
        stream = client.stream_generate("Count: 1, 2, 3,", max_tokens=8, **GREEDY)
        assert stream.result is None
        pieces = list(stream)
        assert len(pieces) > 1 and "".join(pieces) == whole.text != ""
        assert stream.result is not None and stream.result.text == whole.text
        assert stream.result.id == stream.id != whole.id

        stopped = client.generate("Count: 1, 2, 3,", max_tokens=16, stop=[" 6"], **GREEDY)
        assert (stopped.finish_reason, stopped.stop_sequence) == ("stop_sequence", " 6")
        assert stopped.text == " 4, 5,"

        messages = [{"role": "user", "content": "Say hello in French."}]
        chat = client.chat(messages, max_tokens=6, **GREEDY)
        streamed_chat = client.stream_chat(messages, max_tokens=6, **GREEDY)
        assert "".join(streamed_chat) == chat.text != ""
        assert chat.usage.prompt_tokens > 5

        tokens = client.tokenize("媽 🤗 Hello")
        assert tokens[0] == 2 and all(isinstance(token, int) for token in tokens)
        assert client.tokenize("Hello", add_special=False) == [9259]
        assert client.detokenize(tokens) == "媽 🤗 Hello"
        info = client.info()
        assert info["model"]["architecture"] == "gemma3" and info["config"]["n_ctx"] == 4096
        stats = client.stats()
        assert stats["requests"]["by_op"]["chat"] == 2
        assert stats["requests"]["by_op"]["generate"] == 3
        assert client.cancel("nothing-pending") is False

        raw = list(client.request({"op": "generate", "prompt": "Hi", "max_tokens": 3}))
        assert [line["type"] for line in raw] == ["token"] * (len(raw) - 1) + ["done"]
        assert raw[-1]["usage"]["completion_tokens"] == 3

        with pytest.raises(SfcoreError) as error:
            client.generate("x", max_tokens=0)
        assert error.value.code == "invalid_request" and "max_tokens" in error.value.message
        assert error.value.reply is not None and error.value.reply["type"] == "error"
        with pytest.raises(SfcoreError) as error:
            list(client.stream_chat([{"role": "bot", "content": "x"}]))
        assert error.value.code == "invalid_request" and "role" in error.value.message
        with pytest.raises(TypeError, match="max_token"):
            client.generate("x", max_token=3)
        # None leaves an option out: the daemon's default (16 in the test config) applies.
        default = client.generate(LONG, max_tokens=None, temperature=None, seed=None)
        assert 1 <= default.usage.completion_tokens <= 16
        assert client.health()["status"] == "ok"  # the connection survived the errors
        assert counters(path)[0] == 2  # this client's connection and the monitor's


@pytest.mark.asyncio
async def test_blocking_client_every_op_results_and_errors() -> None:
    async with running_daemon() as daemon:
        await in_thread(blocking_ops, daemon.socket_path)


def interleaving(path: str) -> None:
    """A half-read stream does not confuse later calls on the same client."""
    with Client(path, timeout=60) as client:
        reference = client.generate("Count: 1, 2, 3,", max_tokens=10, **GREEDY).text
        stream = client.stream_generate("Count: 1, 2, 3,", max_tokens=10, **GREEDY)
        pieces = iter(stream)
        first = next(pieces)
        assert client.health()["type"] == "health"  # answered after the stream's done
        assert client.tokenize("a", add_special=False) == [236746]
        assert first + "".join(pieces) == reference
        assert stream.result is not None and stream.result.finish_reason == "length"

        # client.cancel(stream.id) in the loop body: the stream ends as cancelled.
        stream = client.stream_generate(LONG, max_tokens=2000)
        for seen, _ in enumerate(stream, 1):
            if seen == 3:
                assert client.cancel(stream.id) is True
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert 3 <= stream.result.usage.completion_tokens < 40
        # stream.cancel(): returns at once; iteration ends soon after.
        stream = client.stream_generate(LONG, max_tokens=2000)
        seen = 0
        for seen, _ in enumerate(stream, 1):
            if seen == 3:
                stream.cancel()
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert seen < 40
        # Cancelled before it was sent: nothing is sent at all.
        unsent = client.stream_generate(LONG)
        unsent.cancel()
        assert list(unsent) == [] and unsent.result is None
        slot_freed(path)


@pytest.mark.asyncio
async def test_half_read_streams_and_cancel_on_one_connection() -> None:
    async with running_daemon() as daemon:
        await in_thread(interleaving, daemon.socket_path)


def leave_early(path: str, how: str) -> None:
    with Client(path, timeout=60) as client:
        client.health()
        before = counters(path)
        stream = client.stream_generate(LONG, max_tokens=2000)
        if how == "break":
            for _ in stream:
                break
        elif how == "exception":
            with pytest.raises(RuntimeError):
                for _ in stream:
                    raise RuntimeError("the caller's own bug")
        elif how == "close":
            pieces = iter(stream)
            next(pieces)
            stream.close()
            assert stream.result is not None and stream.result.finish_reason == "cancelled"
            del pieces
        elif how == "dropped":  # the last reference goes: finalized at once
            pieces = iter(stream)
            next(pieces)
            del pieces, stream
        else:  # "garbage": only a cyclic garbage collection finds it
            pieces = iter(stream)
            next(pieces)
            stream.cycle = (stream, pieces)  # type: ignore[attr-defined]
            del pieces, stream
            gc.collect()
        assert_stopped_early(slot_freed(path), 0)
        # (Each `counters` and `slot_freed` opens a connection of its own.)
        connections, cancels = counters(path)
        assert connections == before[0] + 2
        if how == "garbage":
            # No I/O from a garbage collection: the connection was closed instead.
            assert cancels == before[1]
        else:
            # Cancelled on the same connection, which stays usable.
            assert cancels == before[1] + 1
        # A second connection's request starts at once, and this client goes on working
        # (reconnecting only if it had to close).
        with Client(path, timeout=60) as other:
            assert other.generate("Hi", max_tokens=1).usage.completion_tokens == 1
        assert client.generate("Hi", max_tokens=2).usage.completion_tokens == 2
        assert counters(path)[0] == connections + 2 + (how == "garbage")


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["break", "exception", "close", "dropped", "garbage"])
async def test_leaving_a_stream_early_stops_it_and_frees_the_slot(how: str) -> None:
    async with running_daemon() as daemon:
        await in_thread(leave_early, daemon.socket_path, how)


def cancel_from_another_thread(path: str) -> None:
    with Client(path, timeout=60) as client:
        stream = client.stream_generate(LONG, max_tokens=2000)
        pieces = iter(stream)
        next(pieces)
        timer = threading.Timer(0.3, stream.cancel)
        timer.start()
        rest = list(pieces)
        timer.join()
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert len(rest) < 200
        assert client.health()["busy"] is False


@pytest.mark.asyncio
async def test_stream_cancel_from_another_thread() -> None:
    async with running_daemon() as daemon:
        await in_thread(cancel_from_another_thread, daemon.socket_path)


def leave_while_another_thread_waits(path: str) -> None:
    """Thread B waits on a long request queued behind thread A's stream on the same
    client (B reads A's lines for it). A leaves early: its cancel goes out and its drain
    completes without closing the shared connection, and B gets its answer."""
    # B's one reply line comes after its 300 tokens: on a loaded machine that is minutes.
    with Client(path, timeout=LONG_REPLY_TIMEOUT_S) as client:
        client.health()
        before = counters(path)
        stream = client.stream_generate(LONG, max_tokens=2000)
        pieces = iter(stream)
        next(pieces)
        answer: list[Result] = []
        waiting = threading.Thread(
            target=lambda: answer.append(client.generate(LONG, max_tokens=300, **GREEDY)))
        waiting.start()
        wait_until_read(path, 2)  # B's request is on the wire behind A's stream
        del pieces  # A leaves: cancel, then drain up to the stream's `done`
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        waiting.join(LONG_REPLY_TIMEOUT_S)
        assert answer and answer[0].usage.completion_tokens == 300
        connections, cancels = counters(path)
        # The same connection throughout: only the two monitors' connections are new.
        assert (connections, cancels) == (before[0] + 2, before[1] + 1)


@pytest.mark.asyncio
async def test_leaving_a_stream_while_another_thread_waits_behind_it() -> None:
    async with running_daemon() as daemon:
        await in_thread(leave_while_another_thread_waits, daemon.socket_path)


def leave_a_stream_queued_behind_another(path: str) -> None:
    """Stream B is pipelined behind stream A on one client, so B's lines come only after
    A's `done`. Closing B while A runs must not wait on B's `done` past a deadline and
    then give up the connection A streams on."""
    with Client(path, timeout=60) as client:
        client.health()
        before = counters(path)
        first = client.stream_generate(LONG, max_tokens=600, **GREEDY)
        first_pieces = iter(first)
        next(first_pieces)
        second = client.stream_generate(LONG, max_tokens=2000)
        reader = threading.Thread(target=lambda: list(second))  # it reads A's lines too
        reader.start()
        wait_until_read(path, 2)  # B's request is on the wire behind A's stream
        second.close()
        rest = list(first_pieces)  # A streams on, well past CANCEL_DRAIN_S (600 tokens)
        assert first.result is not None and first.result.usage.completion_tokens == 600
        assert len(rest) > 0
        reader.join(120)
        assert not reader.is_alive()
        assert client.health()["status"] == "ok"
        connections, cancels = counters(path)
        assert (connections, cancels) == (before[0] + 2, before[1] + 1)


@pytest.mark.asyncio
async def test_closing_a_stream_queued_behind_another_keeps_the_connection() -> None:
    async with running_daemon() as daemon:
        await in_thread(leave_a_stream_queued_behind_another, daemon.socket_path)


class PausingClient(Client):
    """Holds the thread that sent a request between sending it and returning it: the
    moment in which another thread may close the stream (seen on a loaded machine)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, timeout=60)
        self.sent = threading.Event()
        self.go_on = threading.Event()

    def _start(self, request: Any, raw: bool = False) -> Any:
        call = super()._start(request, raw)
        if request.get("op") == "generate":
            self.sent.set()
            assert self.go_on.wait(60)
        return call


def close_while_another_thread_sends(path: str) -> None:
    with PausingClient(path) as client:
        client.health()
        before = counters(path)
        stream = client.stream_generate(LONG, max_tokens=2000)
        reader = threading.Thread(target=lambda: list(stream))
        reader.start()
        assert client.sent.wait(60)
        stream.close()  # the request is out, but the reader has not recorded it yet
        client.go_on.set()
        reader.join(120)
        assert not reader.is_alive()
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert stream.result.usage.completion_tokens < 1000
        assert counters(path)[1] == before[1] + 1


@pytest.mark.asyncio
async def test_closing_a_stream_while_another_thread_sends_it_cancels_it() -> None:
    async with running_daemon() as daemon:
        await in_thread(close_while_another_thread_sends, daemon.socket_path)


# --- the asyncio client against the daemon ---

@pytest.mark.asyncio
async def test_async_client_every_op_results_and_errors() -> None:
    async with running_daemon() as daemon, AsyncClient(daemon.socket_path, timeout=60) as client:
        assert (await client.health())["status"] == "ok"
        whole = await client.generate("Count: 1, 2, 3,", max_tokens=8, **GREEDY)
        stream = client.stream_generate("Count: 1, 2, 3,", max_tokens=8, **GREEDY)
        pieces = [piece async for piece in stream]
        assert "".join(pieces) == whole.text != "" and whole.finish_reason == "length"
        assert stream.result is not None and stream.result.text == whole.text
        # The blocking client gives the same text (other clients' tests rely on it).
        reference = await in_thread(_blocking_text, daemon.socket_path)
        assert reference == whole.text

        messages = [{"role": "user", "content": "Say hello in French."}]
        chat = await client.chat(messages, max_tokens=6, **GREEDY)
        chat_stream = client.stream_chat(messages, max_tokens=6, **GREEDY)
        assert "".join([piece async for piece in chat_stream]) == chat.text != ""
        assert await client.tokenize("a", add_special=False) == [236746]
        assert await client.detokenize(await client.tokenize("媽 🤗")) == "媽 🤗"
        assert (await client.info())["model"]["n_vocab"] == 262144
        assert (await client.stats())["requests"]["by_op"]["chat"] == 2
        assert await client.cancel(12345) is False
        raw = [line async for line in client.request({"op": "health"})]
        assert [line["type"] for line in raw] == ["health"]

        # Tasks sharing one client: pipelined on its connection, answered in order.
        results = await asyncio.gather(client.generate("Hi", max_tokens=3), client.health(),
                                       client.tokenize("Hi"), client.generate("Yo", max_tokens=2))
        assert results[0].usage.completion_tokens == 3 and results[1]["type"] == "health"
        assert results[3].usage.completion_tokens == 2

        with pytest.raises(SfcoreError) as error:
            await client.detokenize([-1])
        assert error.value.code == "invalid_request"
        with pytest.raises(SfcoreError) as error:
            async for _ in client.stream_generate("x", top_p=0):
                pass
        assert error.value.code == "invalid_request" and "top_p" in error.value.message
        assert (await client.health())["status"] == "ok"


def _blocking_text(path: str) -> str:
    with Client(path, timeout=60) as client:
        return client.generate("Count: 1, 2, 3,", max_tokens=8, **GREEDY).text


async def async_leave(client: AsyncClient, how: str) -> None:
    stream = client.stream_generate(LONG, max_tokens=2000)
    if how == "break":
        async for _ in stream:
            break
    elif how == "exception":
        with pytest.raises(RuntimeError):
            async for _ in stream:
                raise RuntimeError("the caller's own bug")
    elif how == "aclose":
        async with stream:
            await anext(aiter(stream))
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
    elif how == "task-cancelled":
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in stream:
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:  # "garbage"
        pieces = aiter(stream)
        await anext(pieces)
        stream.cycle = (stream, pieces)  # type: ignore[attr-defined]
        del pieces, stream
        gc.collect()


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["break", "exception", "aclose", "task-cancelled", "garbage"])
async def test_async_stream_left_early_stops_it_and_frees_the_slot(how: str) -> None:
    async with running_daemon() as daemon, AsyncClient(daemon.socket_path, timeout=60) as client:
        await client.health()
        before = await in_thread(counters, daemon.socket_path)
        await async_leave(client, how)
        assert_stopped_early(await in_thread(slot_freed, daemon.socket_path), 0)
        # Every way of leaving cancels on the same connection (a garbage collection only
        # schedules the cancel on the event loop), which stays usable.
        assert (await client.generate("Hi", max_tokens=2)).usage.completion_tokens == 2
        connections, cancels = await in_thread(counters, daemon.socket_path)
        assert cancels == before[1] + 1 and connections == before[0] + 2


@pytest.mark.asyncio
async def test_async_stream_left_while_another_task_waits_behind_it() -> None:
    """Task B's long request is queued behind task A's stream; A leaves early. The cancel
    frees the slot at once; the `cancelled` reply comes only after B's answer (> 3 s),
    and that must not make the client give the shared connection up."""
    async with running_daemon() as daemon, \
            AsyncClient(daemon.socket_path, timeout=LONG_REPLY_TIMEOUT_S) as client:
        await client.health()
        before = await in_thread(counters, daemon.socket_path)
        stream = client.stream_generate(LONG, max_tokens=2000)
        pieces = aiter(stream)
        await anext(pieces)
        waiting = asyncio.create_task(client.generate(LONG, max_tokens=300, **GREEDY))
        # B's request is on the wire behind A's stream.
        await in_thread(wait_until_read, daemon.socket_path, 2)
        del pieces  # A leaves
        result = await asyncio.wait_for(waiting, LONG_REPLY_TIMEOUT_S)
        assert result.usage.completion_tokens == 300
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert (await client.health())["status"] == "ok"
        connections, cancels = await in_thread(counters, daemon.socket_path)
        # The same connection throughout: only the two monitors' connections are new.
        assert (connections, cancels) == (before[0] + 2, before[1] + 1)


@pytest.mark.asyncio
async def test_async_stream_queued_behind_another_left_keeps_the_connection() -> None:
    """Task B's stream is pipelined behind task A's, so B's lines come only after A's
    `done`. B's task is cancelled while A runs: leaving B must not wait on B's `done`
    past a deadline and then give up the connection A streams on."""
    async with running_daemon() as daemon, AsyncClient(daemon.socket_path, timeout=60) as client:
        await client.health()
        before = await in_thread(counters, daemon.socket_path)
        first = client.stream_generate(LONG, max_tokens=600, **GREEDY)
        first_pieces = aiter(first)
        await anext(first_pieces)

        async def second_stream() -> None:
            async with client.stream_generate(LONG, max_tokens=2000) as second:
                async for _ in second:
                    pass

        second = asyncio.create_task(second_stream())
        await in_thread(wait_until_read, daemon.socket_path, 2)  # B is behind A's stream
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(second, 60)
        rest = [piece async for piece in first_pieces]  # 600 tokens: past CANCEL_DRAIN_S
        assert first.result is not None and first.result.usage.completion_tokens == 600
        assert len(rest) > 0
        assert (await client.health())["status"] == "ok"
        connections, cancels = await in_thread(counters, daemon.socket_path)
        assert (connections, cancels) == (before[0] + 2, before[1] + 1)


@pytest.mark.asyncio
async def test_async_cancel_from_another_task() -> None:
    async with running_daemon() as daemon, AsyncClient(daemon.socket_path, timeout=60) as client:
        stream = client.stream_generate(LONG, max_tokens=2000)
        first = asyncio.Event()

        async def canceller() -> bool:
            await asyncio.wait_for(first.wait(), 60)
            return await client.cancel(stream.id)  # queued behind the stream: no deadlock

        task = asyncio.create_task(canceller())
        pieces = 0
        async for _ in stream:
            pieces += 1
            first.set()
        assert await asyncio.wait_for(task, 60) is True
        assert stream.result is not None and stream.result.finish_reason == "cancelled"
        assert pieces < 200


# --- reaching the daemon ---

def test_unreachable_daemon_names_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.sock")
    with pytest.raises(SfcoreConnectionError) as error:
        Client(missing).health()
    assert isinstance(error.value, ConnectionError) and isinstance(error.value, SfcoreError)
    assert error.value.code == "unreachable"
    assert missing in error.value.message and "may not be running" in error.value.message

    async def async_health() -> None:
        await AsyncClient(missing).health()

    with pytest.raises(SfcoreConnectionError) as error:
        asyncio.run(async_health())
    assert missing in error.value.message and error.value.code == "unreachable"


def test_socket_path_argument_env_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SFCORE_SOCKET", "/run/x/env.sock")
    assert Client().socket_path == AsyncClient().socket_path == "/run/x/env.sock"
    assert Client("/arg.sock").socket_path == "/arg.sock"
    assert AsyncClient(socket_path=Path("/arg.sock")).socket_path == "/arg.sock"
    monkeypatch.delenv("SFCORE_SOCKET")
    assert Client().socket_path == "/tmp/sfcore-ai.sock"


@pytest.mark.asyncio
async def test_sfcore_socket_environment_reaches_the_daemon(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_daemon() as daemon:
        monkeypatch.setenv("SFCORE_SOCKET", daemon.socket_path)
        async with AsyncClient() as client:
            assert (await client.health())["status"] == "ok"
        assert await in_thread(_tokenize_with_default_client, "Hi") == [2, 10979]


def _tokenize_with_default_client(text: str) -> list[int]:
    with Client() as client:
        return client.tokenize(text)


# --- wire cases, against a scripted fake daemon ---

Script = Callable[[socket.socket, BinaryIO, int], None]


@contextlib.contextmanager
def fake_daemon(script: Script) -> Iterator[str]:
    """A Unix socket served by `script(conn, requests, n)` for its n-th connection."""
    directory = tempfile.mkdtemp(prefix="sff", dir="/tmp")
    path = str(Path(directory) / "f.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket, n: int) -> None:
        with conn, conn.makefile("rb") as requests, contextlib.suppress(OSError):
            script(conn, requests, n)

    def accept() -> None:
        n = 0
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            n += 1
            thread = threading.Thread(target=serve, args=(conn, n), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield path
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(10)
        for thread in threads:
            thread.join(10)
        Path(path).unlink(missing_ok=True)
        Path(directory).rmdir()


def done_line(request_id: Any, text: str = "", completion_tokens: int = 1) -> bytes:
    return json.dumps({
        "type": "done", "id": request_id, "text": text, "finish_reason": "length",
        "stop_sequence": None,
        "usage": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": completion_tokens},
        "timings": {"queued_ms": 0.1, "prompt_ms": 1.0, "prompt_tok_s": 3000.0,
                    "first_token_ms": 1.2, "decode_ms": 1.0, "decode_tok_s": 50.0,
                    "total_ms": 2.2},
    }, ensure_ascii=False).encode() + b"\n"


def answer_every_request(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    for line in requests:
        conn.sendall(done_line(json.loads(line)["id"], "ok"))


HUGE = "媽" * 3_000_000 + " end"  # a 9 MB `done` line


def huge_done(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    for line in requests:
        request = json.loads(line)
        if request["stream"]:
            tokens = (json.dumps({"type": "token", "id": request["id"], "text": HUGE[:2_000_000]},
                                 ensure_ascii=False).encode() + b"\n")
            conn.sendall(tokens + done_line(request["id"]))
        else:
            conn.sendall(done_line(request["id"], HUGE))


def test_lines_of_any_length() -> None:
    with fake_daemon(huge_done) as path:
        with Client(path, timeout=30) as client:
            assert client.generate("x").text == HUGE
            assert list(client.stream_generate("x")) == [HUGE[:2_000_000]]

        async def main() -> None:
            async with AsyncClient(path, timeout=30) as client:
                assert (await client.generate("x")).text == HUGE
                assert [piece async for piece in client.stream_generate("x")] == [
                    HUGE[:2_000_000]]

        asyncio.run(main())


def out_of_step(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    """The first connection answers with a wrong id; later ones behave."""
    for line in requests:
        request_id = json.loads(line)["id"]
        conn.sendall(done_line("someone-else" if n == 1 else request_id, "ok"))


def closing_error(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    """The first connection is refused as the daemon does (an id of its own, then EOF)."""
    if n == 1:
        conn.sendall(b'{"type":"error","id":"sfc-1","code":"too_many_connections",'
                     b'"message":"too many connections (max 1)"}\n')
        return
    answer_every_request(conn, requests, n)


def hang_up_mid_stream(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    request_id = json.loads(requests.readline())["id"]
    conn.sendall(b"".join(json.dumps({"type": "token", "id": request_id, "text": f"{i} "})
                          .encode() + b"\n" for i in range(3)))


def silent(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    requests.readline()
    requests.read()  # until the client gives up and closes


def test_replies_out_of_step_end_the_connection_and_the_next_call_reconnects() -> None:
    with fake_daemon(out_of_step) as path, Client(path, timeout=30) as client:
        with pytest.raises(SfcoreConnectionError, match="unexpected line"):
            client.generate("x")
        assert client.generate("x").text == "ok"


def test_a_closing_error_code_raises_it_and_the_next_call_reconnects() -> None:
    with fake_daemon(closing_error) as path:
        with Client(path, timeout=30) as client:
            with pytest.raises(SfcoreError) as error:
                client.health()
            assert error.value.code == "too_many_connections"
            assert not isinstance(error.value, SfcoreConnectionError)
            assert client.generate("x").text == "ok"

    async def main() -> None:
        with fake_daemon(closing_error) as path:
            async with AsyncClient(path, timeout=30) as client:
                with pytest.raises(SfcoreError) as error:
                    await client.health()
                assert error.value.code == "too_many_connections"
                assert (await client.generate("x")).text == "ok"

    asyncio.run(main())


def entry(token: int, text: str, *alternatives: tuple[int, str, float]) -> dict[str, Any]:
    return {"token": token, "text": text, "bytes": list(text.encode()), "logprob": -0.5,
            "top_logprobs": [{"token": t, "text": x, "bytes": list(x.encode()), "logprob": v}
                             for t, x, v in alternatives]}


def with_logprobs(conn: socket.socket, requests: BinaryIO, n: int) -> None:
    """The daemon's shapes: entries on token lines and `done` (stream false: all there)."""
    for line in requests:
        request = json.loads(line)
        asked = "logprobs" in request
        done = json.loads(done_line(request["id"], "" if request["stream"] else "Hi!", 2))
        if request["stream"]:
            token = {"type": "token", "id": request["id"], "text": "Hi"}
            if asked:
                token["logprobs"] = [entry(1, "Hi", (1, "Hi", -0.5), (2, "Ho", -1.5))]
                done["logprobs"] = [entry(3, "!", (3, "!", -0.5), (4, "?", -2.0))]
            conn.sendall(json.dumps(token).encode() + b"\n"
                         + json.dumps({"type": "token", "id": request["id"], "text": "!"})
                         .encode() + b"\n")
        elif asked:
            done["logprobs"] = [entry(1, "Hi", (1, "Hi", -0.5), (2, "Ho", -1.5)),
                                entry(3, "!", (3, "!", -0.5), (4, "?", -2.0))]
        conn.sendall(json.dumps(done).encode() + b"\n")


def test_logprobs_are_asked_for_and_come_back_typed() -> None:
    with fake_daemon(with_logprobs) as path, Client(path, timeout=30) as client:
        whole = client.generate("x", logprobs=2).logprobs
        stream = client.stream_chat([{"role": "user", "content": "x"}], logprobs=2)
        assert "".join(stream) == "Hi!"
        assert stream.result is not None and stream.result.logprobs == whole
        assert whole is not None and [e.token for e in whole] == [1, 3]
        first = whole[0]
        assert (first.text, first.bytes, first.logprob) == ("Hi", b"Hi", -0.5)
        assert [(t.token, t.bytes, t.logprob) for t in first.top_logprobs] == [
            (1, b"Hi", -0.5), (2, b"Ho", -1.5)]
        assert client.generate("x").logprobs is None

    async def main() -> None:
        async with AsyncClient(path, timeout=30) as client:
            result = await client.chat([{"role": "user", "content": "x"}], logprobs=0)
            assert result.logprobs is not None and len(result.logprobs) == 2
            stream = client.stream_generate("x", logprobs=2)
            assert [piece async for piece in stream] == ["Hi", "!"]
            assert stream.result is not None and stream.result.logprobs == whole

    with fake_daemon(with_logprobs) as path:
        asyncio.run(main())


def queued_then_tokens(requests_seen: list[dict[str, Any]]) -> Script:
    """A daemon whose streamed requests wait in its queue first: `queued` lines (place 2,
    then 1), a line of a type newer than the client, then tokens and `done`. A
    non-streamed request gets the unknown line and its `done`; other ops a `health`."""
    def script(conn: socket.socket, requests: BinaryIO, n: int) -> None:
        for line in requests:
            request = json.loads(line)
            requests_seen.append(request)
            request_id = request["id"]
            if request["op"] not in ("generate", "chat"):
                conn.sendall(json.dumps({"type": "health", "id": request_id,
                                         "status": "ok"}).encode() + b"\n")
                continue
            lines = [{"type": "future_kind", "id": request_id, "detail": [1, 2]}]
            if request["stream"]:
                lines = [{"type": "queued", "id": request_id, "position": 2, "queue_depth": 3},
                         {"type": "queued", "id": request_id, "position": 1, "queue_depth": 2},
                         *lines,
                         {"type": "token", "id": request_id, "text": "Hi"},
                         {"type": "token", "id": request_id, "text": "!"}]
            conn.sendall(b"".join(json.dumps(reply).encode() + b"\n" for reply in lines)
                         + done_line(request_id, "" if request["stream"] else "Hi!", 2))
    return script


def test_queued_lines_report_the_place_and_priority_is_sent_only_when_given() -> None:
    """A stream that waits in the daemon's queue (`queued` lines), or gets a line type
    newer than the client, yields its pieces and result as usual and reports its place
    through on_queued and queue_position; `priority` is on the wire only when given."""
    seen: list[dict[str, Any]] = []
    with fake_daemon(queued_then_tokens(seen)) as path, Client(path, timeout=30) as client:
        places: list[QueuePosition] = []
        stream = client.stream_generate("x", priority="background", on_queued=places.append)
        assert stream.queue_position is None
        assert list(stream) == ["Hi", "!"]
        assert places == [QueuePosition(2, 3), QueuePosition(1, 2)]
        assert stream.queue_position == QueuePosition(position=1, queue_depth=2)
        assert stream.result is not None and stream.result.text == "Hi!"
        assert stream.result.finish_reason == "length"
        # Without a callback: the same pieces; the place is still kept.
        chat = client.stream_chat([{"role": "user", "content": "x"}], priority="interactive")
        assert "".join(chat) == "Hi!" and chat.queue_position == QueuePosition(1, 2)
        assert client.generate("x").text == "Hi!"  # an unknown line before a `done`
        assert client.chat([{"role": "user", "content": "x"}], priority="background").text \
            == "Hi!"
        raw = list(client.request({"op": "generate", "prompt": "x", "stream": True}))
        assert [line["type"] for line in raw] == [
            "queued", "queued", "future_kind", "token", "token", "done"]
        assert client.health()["status"] == "ok"  # the connection stayed in step
        # A callback that raises leaves the stream: it is cancelled, the error goes up.
        def fail(place: QueuePosition) -> None:
            raise RuntimeError("stop")
        with pytest.raises(RuntimeError, match="stop"):
            list(client.stream_generate("x", on_queued=fail))
    assert [request.get("priority") for request in seen[:5]] == [
        "background", "interactive", None, "background", None]
    assert "priority" not in seen[2] and "priority" not in seen[4]

    async def main() -> None:
        with fake_daemon(queued_then_tokens(seen)) as path:
            async with AsyncClient(path, timeout=30) as client:
                places: list[QueuePosition] = []
                stream = client.stream_chat([{"role": "user", "content": "x"}],
                                            priority="background", on_queued=places.append)
                assert [piece async for piece in stream] == ["Hi", "!"]
                assert places == [QueuePosition(2, 3), QueuePosition(1, 2)]
                assert stream.queue_position == QueuePosition(1, 2)
                assert stream.result is not None and stream.result.text == "Hi!"
                plain = client.stream_generate("x")
                assert [piece async for piece in plain] == ["Hi", "!"]
                assert (await client.generate("x", priority="interactive")).text == "Hi!"
                raw = [line async for line in client.request(
                    {"op": "chat", "messages": [], "stream": True})]
                assert [line["type"] for line in raw][:3] == ["queued", "queued", "future_kind"]
                assert (await client.health())["status"] == "ok"

    seen.clear()
    asyncio.run(main())
    assert [request.get("priority") for request in seen[:3]] == [
        "background", None, "interactive"]
    assert "priority" not in seen[1]


def test_a_hang_up_mid_stream_raises_after_the_pieces_that_came() -> None:
    with fake_daemon(hang_up_mid_stream) as path, Client(path, timeout=30) as client:
        pieces: list[str] = []
        with pytest.raises(SfcoreConnectionError, match="closed the connection"):
            pieces.extend(client.stream_generate("x"))
        assert pieces == ["0 ", "1 ", "2 "]

    async def main() -> None:
        with fake_daemon(hang_up_mid_stream) as path:
            async with AsyncClient(path, timeout=30) as client:
                got: list[str] = []
                with pytest.raises(SfcoreConnectionError):
                    async for piece in client.stream_generate("x"):
                        got.append(piece)
                assert got == ["0 ", "1 ", "2 "]

    asyncio.run(main())


def test_timeouts_are_bounded() -> None:
    with fake_daemon(silent) as path:
        start = time.monotonic()
        with Client(path, timeout=0.3) as client, pytest.raises(SfcoreTimeoutError) as error:
            client.health()
        assert 0.25 < time.monotonic() - start < 5
        assert error.value.code == "timeout" and isinstance(error.value, TimeoutError)

        async def main() -> None:
            async with AsyncClient(path, timeout=0.3) as client:
                with pytest.raises(SfcoreTimeoutError):
                    await client.health()

        start = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - start < 5


# --- cost per token, and the distribution ---

def test_per_token_parsing_cost() -> None:
    """The reading path costs little beyond json.loads (benchmarks/parse_tokens.py).
    Bounds are loose (a shared, noisy machine); a task or a wait_for per line would
    still break them."""
    bench_path = REPO / "clients/python/benchmarks/parse_tokens.py"
    spec = importlib.util.spec_from_file_location("parse_tokens", bench_path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    figures = bench.measure(count=20_000, runs=3)
    cpu = {name: min(cpu for _, cpu in values) for name, values in figures.items()}
    print(f"thread CPU us/token: {cpu}")
    for name in ("Client", "AsyncClient"):
        assert cpu[name] < 3 * cpu["json.loads only"] + 3, (name, cpu)


def test_wheel_has_no_dependency_and_ships_types_and_the_command(tmp_path: Path) -> None:
    # Built from a copy: the checkout gets no build/ or egg-info from it.
    source = tmp_path / "source"
    shutil.copytree(REPO / "clients/python", source,
                    ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w",
         str(tmp_path / "wheels"), str(source)],
        capture_output=True, text=True, timeout=120, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheels").glob("sfcore_client-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith("/METADATA"))).decode()
        entry_points = archive.read(
            next(n for n in names if n.endswith("/entry_points.txt"))).decode()
    assert {"sfcore_client/py.typed", "sfcore_client/cli.py", "sfcore_client/aio.py"} <= names
    assert not any(name.startswith("benchmarks/") for name in names)
    assert "Requires-Python: >=3.11" in metadata and "Requires-Dist" not in metadata
    assert "sfcore = sfcore_client.cli:main" in entry_points


@pytest.mark.asyncio
async def test_logprobs_through_the_client_against_the_real_daemon() -> None:
    """The typed entries from a live daemon: one per generated token, their bytes the
    text, each with the asked-for alternatives, best first."""
    async with running_daemon() as daemon:
        def ask() -> None:
            with Client(daemon.socket_path, timeout=60) as client:
                result = client.generate("Count: 1, 2, 3,", max_tokens=6, logprobs=3, **GREEDY)
                entries = result.logprobs
                assert entries is not None and len(entries) == result.usage.completion_tokens
                assert b"".join(entry.bytes for entry in entries) == result.text.encode()
                for entry in entries:
                    assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
                    assert entry.top_logprobs[0].token == entry.token
                    values = [top.logprob for top in entry.top_logprobs]
                    assert values == sorted(values, reverse=True)
                assert client.generate("Hi", max_tokens=2).logprobs is None

        await in_thread(ask)


# --- tool calls ---

WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}
ADD_PARAMETERS = {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [function_tool("get_weather", "The weather in a city now", WEATHER_PARAMETERS),
         {"type": "function", "function": {"name": "add", "description": "The sum of two "
                                           "integers", "parameters": ADD_PARAMETERS}}]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
TOOL_QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
TOOL_SEEDS = range(3)
# Room for a call or two of these tools (the shortest takes 15 tokens).
TOOL_MAX_TOKENS = 40


def assert_valid_calls(result: Result, names: set[str]) -> None:
    assert result.finish_reason == "tool_calls", result
    assert result.tool_calls, result
    for call in result.tool_calls:
        assert isinstance(call, ToolCall) and call.id.startswith("call_")
        assert call.name in names
        jsonschema.validate(call.arguments, PARAMETERS[call.name])


def run_the_function(call: ToolCall) -> str:
    if call.name == "add":
        return str(call.arguments["a"] + call.arguments["b"])
    return f"21 C, sunny in {call.arguments['city']}"


def answered(first: Result) -> list[dict[str, Any]]:
    """The conversation sent back: the question, the assistant's calls, their results."""
    return [*TOOL_QUESTION, assistant_message(first),
            *(tool_message(call, run_the_function(call)) for call in first.tool_calls)]


def tool_round_trip(path: str) -> None:
    with Client(path, timeout=LONG_REPLY_TIMEOUT_S) as client:
        for seed in TOOL_SEEDS:
            forced = client.chat(TOOL_QUESTION, tools=TOOLS, tool_choice="required",
                                 temperature=1.0, seed=seed, max_tokens=TOOL_MAX_TOKENS)
            assert_valid_calls(forced, {"get_weather", "add"})
        # A function's name: exactly one call of it; streamed, the call is in the result.
        stream = client.stream_chat(TOOL_QUESTION, tools=TOOLS, tool_choice="add",
                                    parallel_tool_calls=False, temperature=1.0, seed=7,
                                    max_tokens=TOOL_MAX_TOKENS)
        assert "".join(stream) == ""
        assert stream.result is not None
        assert_valid_calls(stream.result, {"add"})
        assert len(stream.result.tool_calls) == 1
        final = client.chat(answered(stream.result), tools=TOOLS, temperature=0,
                            max_tokens=12)
        assert final.finish_reason in ("stop", "length", "tool_calls")
        # No tools, no calls.
        plain = client.chat(TOOL_QUESTION, max_tokens=4, temperature=0)
        assert plain.tool_calls == () and plain.finish_reason != "tool_calls"
        with pytest.raises(SfcoreError) as error:
            client.chat(TOOL_QUESTION, tools=TOOLS, tool_choice="nope")
        assert error.value.code == "invalid_request"
        assert "$.tool_choice.function.name" in error.value.message


@pytest.mark.asyncio
async def test_tool_calls_round_trip_with_both_clients() -> None:
    """Forced calls at temperature 1.0 name a tool and validate against its parameters;
    the assistant's calls and the tools' results go back and get an answer."""
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        await in_thread(tool_round_trip, daemon.socket_path, timeout=LONG_REPLY_TIMEOUT_S * 2)
        async with AsyncClient(daemon.socket_path, timeout=LONG_REPLY_TIMEOUT_S) as client:
            forced = await asyncio.gather(*(
                client.chat(TOOL_QUESTION, tools=TOOLS, tool_choice="required",
                            temperature=1.0, seed=seed, max_tokens=TOOL_MAX_TOKENS)
                for seed in TOOL_SEEDS))
            for result in forced:
                assert_valid_calls(result, {"get_weather", "add"})
            named = await client.chat(TOOL_QUESTION, tools=TOOLS, tool_choice="get_weather",
                                      temperature=1.0, seed=3, max_tokens=TOOL_MAX_TOKENS)
            assert_valid_calls(named, {"get_weather"})
            assert len(named.tool_calls) == 1
            final = await client.chat(answered(named), tools=TOOLS, temperature=0,
                                      max_tokens=12)
            assert final.finish_reason in ("stop", "length", "tool_calls")


def test_tool_options_and_messages_on_the_wire() -> None:
    chat = generation_request("chat", "messages", [], False, {
        "tools": TOOLS, "tool_choice": "add", "parallel_tool_calls": False})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["tools"][0] == {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": WEATHER_PARAMETERS}}
    assert chat["parallel_tool_calls"] is False
    for mode in ("auto", "required", "none"):
        assert generation_request("chat", "messages", [], False,
                                  {"tool_choice": mode})["tool_choice"] == mode
    with pytest.raises(TypeError, match="tools"):
        generation_request("generate", "prompt", "x", False, {"tools": TOOLS})
    assert function_tool("f") == {"type": "function",
                                  "function": {"name": "f", "description": ""}}
    call = ToolCall(id="call_1", name="add", arguments={"a": 2, "b": 3})
    sent = chat_messages([{"role": "assistant", "content": "", "tool_calls": [call]},
                          tool_message("call_1", "5")])
    assert sent == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(
    st.text(min_size=1, max_size=20), st.from_regex(r"[A-Za-z0-9_.-]{1,64}", fullmatch=True),
    st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)), max_size=4),
    text=st.text(max_size=20))
def test_a_done_lines_calls_go_back_as_they_came(
        calls: list[tuple[str, str, dict[str, Any]]], text: str) -> None:
    """result_of reads any `tool_calls` the daemon sends, and assistant_message gives the
    same calls back on the wire (through JSON, as the client sends them)."""
    wire = [{"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in calls]
    done = json.loads(done_line(1, text))
    if wire:
        done["tool_calls"], done["finish_reason"] = wire, "tool_calls"
    result = result_of(done, text)
    assert [(call.id, call.name, call.arguments) for call in result.tool_calls] == calls
    message = json.loads(json.dumps(chat_messages([assistant_message(result)])))[0]
    assert message["content"] == text
    assert message.get("tool_calls", []) == wire
