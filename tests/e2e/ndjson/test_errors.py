"""Bad input and limits over a real socket: a structured error, and the daemon keeps serving."""

from __future__ import annotations

import os

import pytest

from tests.kit import done_of, running_daemon

pytestmark = pytest.mark.asyncio

HEALTH = {"op": "health", "id": "still-alive"}


async def test_bad_json_keeps_the_connection_open() -> None:
    bad_lines = [
        b'{"prompt": NaN}\n',
        b'{"prompt": "x", "temperature": Infinity}\n',
        b'{"prompt": "\xff\xfe bad utf-8"}\n',
        b'{"prompt": "\\ud800 lone surrogate"}\n',
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n",
        b"[1, 2, 3]\n",
        b"not json at all\n",
        b'{"prompt": "unterminated\n',
    ]
    async with running_daemon() as daemon, daemon.client() as client:
        for line in bad_lines:
            error = await client.final(line)
            assert error["type"] == "error", line[:40]
            assert error["code"] == "bad_json", (line[:40], error)
            assert error["message"]
            assert isinstance(error["id"], str) and error["id"].startswith("sfc-")
        assert (await client.final(HEALTH))["status"] == "ok"
        done = done_of(await client.request({"prompt": "Hello", "max_tokens": 2}))
        assert done["usage"]["completion_tokens"] == 2


async def test_invalid_requests_name_the_field_and_keep_the_id() -> None:
    cases = [
        ({"id": "a", "prompt": "hi", "max_tokens": 0}, "$.max_tokens"),
        ({"id": "b", "prompt": "hi", "temperature": "hot"}, "$.temperature"),
        ({"id": "c", "prompt": "hi", "top_p": 1.5}, "$.top_p"),
        ({"id": "d", "prompt": "hi", "stop": ["ok", ""]}, "$.stop[1]"),
        ({"id": "e", "prompt": ""}, "$.prompt"),
        ({"id": "f", "op": "explode"}, "$.op"),
        ({"id": "g", "prompt": "hi", "max_tokens": 3, "tempreature": 0}, "tempreature"),
        ({"id": "h"}, "prompt"),
    ]
    async with running_daemon() as daemon, daemon.client() as client:
        for request, field in cases:
            error = await client.final(request)
            assert error["type"] == "error" and error["code"] == "invalid_request", error
            assert error["id"] == request["id"]
            assert field in error["message"], (field, error["message"])
        assert (await client.final(HEALTH))["id"] == "still-alive"


async def test_empty_and_blank_lines_are_ignored() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        await client.send(b"\n   \n\t\r\n", HEALTH)
        health = await client.recv()
        assert health is not None and health["id"] == "still-alive"


async def test_line_too_long_answers_then_closes_and_runs_nothing_after_the_cut() -> None:
    async with running_daemon({"server": {"max_line_bytes": 1024}}) as daemon:
        async with daemon.client() as client:
            long_prompt = {"id": "long", "prompt": "x" * 2000}
            await client.send({"id": "before", "op": "health"}, long_prompt,
                              {"id": "after", "prompt": "Hello", "max_tokens": 50})
            first = await client.recv()
            assert first is not None and first["id"] == "before"
            error = await client.recv()
            assert error is not None and error["code"] == "line_too_long"
            assert "1024" in error["message"]
            await client.expect_eof()
        # The request after the cut never ran: the slot is idle and nothing is queued.
        async with daemon.client() as other:
            health = await other.final(HEALTH)
            assert health["busy"] is False and health["queue_depth"] == 0
            # A line of exactly the limit is fine.
            exact = b'{"op": "health", "id": "' + b"y" * (1024 - 26) + b'"}'
            assert len(exact) == 1024
            reply = await other.final(exact + b"\n")
            assert reply["type"] == "health"


async def test_too_many_connections() -> None:
    async with running_daemon({"server": {"max_connections": 2}}) as daemon:
        async with daemon.client() as first, daemon.client() as second:
            assert (await first.final(HEALTH))["status"] == "ok"
            assert (await second.final(HEALTH))["status"] == "ok"
            async with daemon.client() as third:
                error = await third.recv()
                assert error is not None and error["code"] == "too_many_connections"
                await third.expect_eof()
            # The admitted connections are unaffected.
            assert (await first.final(HEALTH))["status"] == "ok"


async def test_forbidden_uid_is_refused_and_allowed_uid_is_served() -> None:
    other_uid = os.getuid() + 1
    async with running_daemon({"server": {"allowed_uids": [other_uid]}}) as daemon:
        async with daemon.client() as client:
            error = await client.recv()
            assert error is not None and error["code"] == "forbidden"
            assert str(os.getuid()) in error["message"]
            await client.expect_eof()
    async with running_daemon({"server": {"allowed_uids": [other_uid, os.getuid()]}}) as daemon:
        async with daemon.client() as client:
            assert (await client.final(HEALTH))["status"] == "ok"


async def test_queue_full_and_nothing_accepted_is_lost() -> None:
    async with running_daemon({"server": {"max_queue": 1, "slots": 1}}) as daemon:
        async with daemon.client() as runner, daemon.client() as waiter, \
                daemon.client() as extra:
            await runner.start_streaming({"id": "run", "prompt": "Tell a story.", "max_tokens": 60})
            await waiter.send({"id": "wait", "prompt": "Hello", "max_tokens": 5})
            # The health answer proves the waiting request was queued before we go on.
            assert (await extra.final(HEALTH))["queue_depth"] == 1
            error = await extra.final({"id": "over", "prompt": "Hi", "max_tokens": 5})
            assert error["code"] == "queue_full" and error["id"] == "over"
            # Both accepted requests complete.
            assert done_of(await runner.reply())["usage"]["completion_tokens"] == 60
            assert done_of(await waiter.reply())["usage"]["completion_tokens"] == 5
            assert (await extra.final(HEALTH))["queue_depth"] == 0


async def test_a_full_queue_refuses_before_any_costly_check() -> None:
    """Capacity is checked first: a request the queue cannot take is answered
    queue_full before its schema is compiled (an invalid one would say so otherwise)."""
    bad_schema = {"type": "object", "properties": {"x": {"type": "strin"}}}
    async with running_daemon({"server": {"max_queue": 0, "slots": 1}}) as daemon:
        async with daemon.client() as runner, daemon.client() as extra:
            await runner.start_streaming({"id": "run", "prompt": "Tell a story.",
                                          "max_tokens": 60})
            error = await extra.final({"id": "over", "prompt": "Hi", "json_schema": bad_schema})
            assert error["code"] == "queue_full" and error["id"] == "over", error
            assert done_of(await runner.reply())["usage"]["completion_tokens"] == 60
            # With room again, the same request reaches the schema check.
            error = await extra.final({"id": "now", "prompt": "Hi", "json_schema": bad_schema})
            assert error["code"] == "invalid_request", error
            stats = await extra.final({"op": "stats"})
            assert stats["errors"]["queue_full"] == 1


async def test_queue_full_on_a_pipelined_connection_keeps_reply_order() -> None:
    async with running_daemon({"server": {"max_queue": 0, "slots": 1}}) as daemon:
        async with daemon.client() as client:
            await client.send({"id": 1, "prompt": "One", "max_tokens": 20},
                              {"id": 2, "prompt": "Two", "max_tokens": 5})
            first = await client.reply()
            assert done_of(first)["id"] == 1
            second = (await client.reply())[-1]
            # Request 2 arrived while 1 was running and max_queue is 0; its error
            # line waited until request 1 was answered in full.
            assert second["id"] == 2 and second["code"] == "queue_full"
