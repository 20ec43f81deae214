"""Short requests beside a long one (issue 64): a request's `priority`, the wait queue
that serves interactive requests first, and the `queued` line a waiting stream gets.

One slot, held by a request whose grammar never completes until the test cancels it,
so whatever comes next surely waits; every wait is on a reply line, none on a clock.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.kit import done_of, running_daemon
from tests.kit.faults import health, poll_until

pytestmark = pytest.mark.asyncio

ONE_SLOT = {"server": {"slots": 1}}
RUNNER = {"id": "runner", "prompt": "Write.", "grammar": "root ::= [a-z ] root",
          "temperature": 0, "max_tokens": 2000}
TIMEOUT_S = 120


def queued(request_id: str, position: int, depth: int) -> dict[str, Any]:
    return {"type": "queued", "id": request_id, "position": position, "queue_depth": depth}


async def test_a_stream_behind_a_busy_slot_is_told_its_place_then_streams() -> None:
    async with running_daemon(ONE_SLOT) as daemon:
        runner, waiter, quiet = [await daemon.connect() for _ in range(3)]
        try:
            await runner.start_streaming(RUNNER)
            await waiter.send({"id": "w", "prompt": "Hi", "max_tokens": 4, "temperature": 0})
            assert await waiter.recv(TIMEOUT_S) == queued("w", 1, 1)
            # A reply written whole says nothing before its end.
            await quiet.send({"id": "q", "prompt": "Hi", "max_tokens": 4, "stream": False,
                              "temperature": 0})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 2,
                             timeout=30, what="the second request queued")
            await runner.send({"op": "cancel", "target": "runner"})
            assert done_of(await runner.reply(TIMEOUT_S))["finish_reason"] == "cancelled"
            lines = await waiter.reply(TIMEOUT_S)
            assert [line["type"] for line in lines] == ["token"] * (len(lines) - 1) + ["done"]
            assert len(lines) > 1 and done_of(lines)["usage"]["completion_tokens"] == 4
            whole = await quiet.reply(TIMEOUT_S)
            assert len(whole) == 1 and done_of(whole)["usage"]["completion_tokens"] == 4
        finally:
            for client in (runner, waiter, quiet):
                await client.close()


async def test_an_interactive_request_sent_after_a_background_one_starts_first() -> None:
    async with running_daemon(ONE_SLOT) as daemon:
        runner, background, interactive = [await daemon.connect() for _ in range(3)]
        try:
            await runner.start_streaming(RUNNER)
            await background.send({"id": "bg", "prompt": "Hi", "max_tokens": 4,
                                   "temperature": 0, "priority": "background"})
            assert await background.recv(TIMEOUT_S) == queued("bg", 1, 1)
            await interactive.send({"id": "in", "prompt": "Hi", "max_tokens": 4,
                                    "temperature": 0})
            # It goes ahead of the background one, which is told it is second now.
            assert await interactive.recv(TIMEOUT_S) == queued("in", 1, 2)
            assert await background.recv(TIMEOUT_S) == queued("bg", 2, 2)
            await runner.send({"op": "cancel", "target": "runner"})
            assert done_of(await runner.reply(TIMEOUT_S))["finish_reason"] == "cancelled"
            first = await interactive.reply(TIMEOUT_S)
            later = await background.reply(TIMEOUT_S)
        finally:
            for client in (runner, background, interactive):
                await client.close()
        # The slot went to the interactive one: the background one moved up, then ran.
        assert later[0] == queued("bg", 1, 1), later
        assert all(line["type"] == "token" for line in later[1:-1]), later
        assert done_of(first)["usage"]["completion_tokens"] == 4
        assert done_of(later)["usage"]["completion_tokens"] == 4
        # It came first and started later, so it waited longer.
        assert done_of(later)["timings"]["queued_ms"] > done_of(first)["timings"]["queued_ms"]


async def test_a_bad_priority_is_an_invalid_request_and_the_connection_goes_on() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        for request in ({"id": "g", "prompt": "Hi", "priority": "urgent"},
                        {"id": "c", "op": "chat", "priority": 1,
                         "messages": [{"role": "user", "content": "Hi"}]}):
            error = await client.final(request)
            assert error["type"] == "error" and error["id"] == request["id"], error
            assert error["code"] == "invalid_request", error
            assert "`$.priority`" in error["message"], error
        fine = {"id": "ok", "prompt": "Hi", "max_tokens": 2, "temperature": 0,
                "priority": "background"}
        done = done_of(await client.request(fine, TIMEOUT_S))
        assert done["usage"]["completion_tokens"] == 2
        assert (await client.final({"op": "health"}))["status"] == "ok"
