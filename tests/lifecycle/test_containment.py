"""A failure while the decode thread serves one request stays with that request; a
failure that kills the decode thread ends the daemon, loudly and at once.

Faults are injected through SFCORE_FAILPOINT (sfcore_daemon/faults.py): "POINT@N" makes
POINT fail (a MemoryError, as a copy of a state or an n-gram index may meet) while it
serves the request whose max_tokens is N. Real daemon, real model.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.kit import REPO, Client, Daemon, done_of, running_daemon
from tests.kit.prompts import COPY_CODE, PREFIX, QUESTION_1, QUESTION_2, RECORD_SCHEMA

# max_tokens that arm each point (see faults.py).
DRAFTER, KEEP, RESTORE, CLOSER, END, THREAD = 41, 42, 43, 44, 45, 46
FAILPOINTS = (f"drafter@{DRAFTER},keep@{KEEP},restore@{RESTORE},closer@{CLOSER},"
              f"end@{END}")
# A long sampled story: it is still streaming when the fault hits, and then cancelled.
BYSTANDER = {"prompt": "Write a very long story about a lighthouse keeper.", "temperature": 0.8,
             "seed": 1, "max_tokens": 1500, "stream": True}
OTHER = " ".join(f"Line {i}: nothing to do with boxes or stones, only words." for i in range(40))
OTHER_2 = " ".join(f"Entry {i}: the river bends {i % 5} times near the mill." for i in range(40))
LONG = PREFIX + " The end of the records."


def config(**extra: Any) -> dict[str, Any]:
    return {"server": {"slots": 2}, "cache": {"min_tokens": 64},
            "generation": {"max_tokens": 64}, **extra}


async def generate(daemon: Daemon, request: dict[str, Any]) -> list[dict[str, Any]]:
    async with daemon.client() as client:
        return await client.request({"temperature": 0, "stream": False, **request}, timeout=180)


@contextlib.asynccontextmanager
async def bystander(daemon: Daemon) -> AsyncIterator[None]:
    """A request streaming in the other slot all the while; it must end `done`
    (cancelled by the test, or ended by itself), whatever happened beside it."""
    async with daemon.client() as client:
        await client.start_streaming({"id": "bystander", **BYSTANDER})
        yield
        await client.send({"op": "cancel", "target": "bystander"})
        done = await _done_of_stream(client)
        assert done["finish_reason"] in ("cancelled", "stop", "length"), done


async def _done_of_stream(client: Client) -> dict[str, Any]:
    while True:
        line = await client.recv(120)
        assert line is not None, "the bystander's connection closed"
        assert line["type"] in ("token", "cancelled", "done"), line
        if line["type"] == "done":
            return line


async def contained(daemon: Daemon, what: str) -> list[str]:
    """The log lines of `what` failing while its request went on (at least one)."""
    return contained_lines(await daemon.log_with(f": {what}"), what)


def contained_lines(log: str, what: str) -> list[str]:
    return [line for line in log.splitlines()
            if f": {what}" in line and "failed (injected fault" in line
            and "the request went on" in line]


@pytest.mark.asyncio
async def test_a_failing_drafter_leaves_its_request_one_token_a_step() -> None:
    async with running_daemon(config(), env={"SFCORE_FAILPOINT": FAILPOINTS}) as daemon:
        async with bystander(daemon):
            copied = done_of(await generate(daemon, {**COPY_CODE, "max_tokens": DRAFTER}))
        assert copied["usage"]["completion_tokens"] == DRAFTER, copied
        assert copied["usage"]["drafted_tokens"] == 0, copied
        assert len(await contained(daemon, "the drafter")) == 1, daemon.log
        # Only that request: the next one drafts.
        again = done_of(await generate(daemon, {**COPY_CODE, "max_tokens": 40}))
        assert again["usage"]["drafted_tokens"] > 0, again


@pytest.mark.asyncio
async def test_a_state_that_cannot_be_taken_is_not_stored_and_that_is_all() -> None:
    async with running_daemon(config(), env={"SFCORE_FAILPOINT": FAILPOINTS}) as daemon:
        async with bystander(daemon):
            kept = done_of(await generate(daemon, {"prompt": OTHER, "max_tokens": KEEP}))
        assert kept["finish_reason"] in ("length", "stop"), kept
        async with daemon.client() as client:
            cache = (await client.final({"op": "stats"}))["cache"]
            states = (await client.final({"op": "cache"}))["states"]
        assert cache["errors"] >= 1, cache
        assert not any("Line 0: nothing" in state["preview"] for state in states), states
        assert await contained(daemon, "keeping a prompt"), daemon.log
        # The store goes on: the next long prompt is stored.
        done_of(await generate(daemon, {"prompt": OTHER_2, "max_tokens": 2}))
        async with daemon.client() as client:
            states = (await client.final({"op": "cache"}))["states"]
        assert any("Entry 0: the river" in state["preview"] for state in states), states


@pytest.mark.asyncio
async def test_a_failure_while_ending_a_request_still_answers_it_done() -> None:
    async with running_daemon(config(), env={"SFCORE_FAILPOINT": FAILPOINTS}) as daemon:
        # Its reply is whole, so it is `done`; its slot's cells are dropped.
        async with bystander(daemon):
            ended = done_of(await generate(daemon, {"prompt": "Count to fifty:",
                                                    "max_tokens": END}))
        assert ended["finish_reason"] in ("length", "stop"), ended
        assert await contained(daemon, "ending the request"), daemon.log
        assert done_of(await generate(daemon, {"prompt": "Count to fifty:", "max_tokens": 4}))


@pytest.mark.asyncio
async def test_a_failing_draw_with_a_json_closer_ends_that_request_alone() -> None:
    async with running_daemon(config(), env={"SFCORE_FAILPOINT": FAILPOINTS}) as daemon:
        async with bystander(daemon):
            closed = await generate(daemon, {**COPY_CODE, "max_tokens": CLOSER,
                                             "json_schema": RECORD_SCHEMA})
        assert closed[-1]["type"] == "error" and closed[-1]["code"] == "internal", closed
        assert done_of(await generate(daemon, {"prompt": "Hello", "max_tokens": 4}))


@pytest.mark.asyncio
async def test_a_restore_that_fails_evaluates_the_prompt_beside_a_running_request() -> None:
    env = {"SFCORE_FAILPOINT": FAILPOINTS}
    async with running_daemon(config(), env=env) as daemon:
        first = done_of(await generate(daemon, {"prompt": LONG + QUESTION_1, "max_tokens": 8}))
        assert first["timings"]["cache_source"] == "none"
        # Two other long prompts take both slots' cells: the prefix is in the store only.
        for prompt in (OTHER, OTHER_2):
            done_of(await generate(daemon, {"prompt": prompt, "max_tokens": 2}))
        async with bystander(daemon):
            failed = done_of(await generate(daemon, {"prompt": LONG + QUESTION_2,
                                                     "max_tokens": RESTORE}))
        # Restored, then the fault: the prompt was evaluated instead.
        assert failed["timings"]["cache_source"] == "none", failed
        assert failed["usage"]["cached_tokens"] == 0, failed
        assert failed["usage"]["completion_tokens"] > 0, failed
        assert await contained(daemon, "restoring a prompt state"), daemon.log
        # The store still serves the next one.
        again = done_of(await generate(daemon, {"prompt": LONG + QUESTION_2, "max_tokens": 4}))
        assert again["timings"]["cache_source"] in ("ram", "slot"), again


@pytest.mark.asyncio
async def test_a_dead_decode_thread_answers_everyone_and_exits_non_zero() -> None:
    env = {"SFCORE_FAILPOINT": f"decode_thread@{THREAD}"}
    async with running_daemon(config(), env=env, expect_clean_exit=False) as daemon:
        running = await daemon.connect()
        others = await daemon.connect()
        try:
            await running.start_streaming({"id": "running", **BYSTANDER})
            # The first starts in the free slot and kills the decode thread as it does;
            # the second waits for a slot (two pipelined: it is queued first).
            await others.send({"id": "killer", "prompt": "Hi", "max_tokens": THREAD},
                              {"id": "waiting", "prompt": "Hi", "max_tokens": 8})
            last = await _last_line(running)
            assert last["type"] == "error" and last["code"] == "internal", last
            assert "decode thread" in last["message"], last
            answers = [await _last_line(others), await _last_line(others)]
            assert [(a["id"], a["type"], a["code"]) for a in answers if a] == [
                ("killer", "error", "internal"), ("waiting", "error", "internal")], answers
            # Never "ok" again: a draining reply, a refusal, or a connection closed.
            assert await _health_after_failure(daemon) != "ok"
            assert await daemon.wait_exit(60) == 70
        finally:
            await running.close()
            await others.close()
        log = daemon.log
        assert "sfcore_daemon.core.server: the decode thread died" in log, log
        assert "InjectedFault: injected fault at decode_thread" in log, log


async def _last_line(client: Client) -> dict[str, Any]:
    while True:
        line = await client.recv(60)
        assert line is not None, "closed without a final line"
        if line["type"] not in ("token", "queued"):
            return line


async def _health_after_failure(daemon: Daemon) -> str:
    try:
        async with daemon.client() as client:
            await client.send({"op": "health"})
            reply = await client.recv(30)
    except (ConnectionError, FileNotFoundError, OSError):
        return "refused"
    if reply is None:
        return "closed"
    return str(reply.get("status", reply.get("code")))


def test_the_unit_restarts_the_daemon_after_a_failure() -> None:
    unit = (REPO / "systemd" / "sfcore-ai.service").read_text()
    lines = {line.strip() for line in unit.splitlines() if not line.startswith("#")}
    assert "Restart=on-failure" in lines
    # 70 (the decode thread died) is restarted; only 2 (a configuration error) is not.
    assert "RestartPreventExitStatus=2" in lines
