"""One request's failure is that request's alone (issue 15).

With parallel slots one llama_decode serves every client; these tests run a
well-behaved stream beside a request that fails in the middle of the shared step
and check that only the failing request ends, with its own specific error.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import Daemon, done_of, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

STORY = {"id": "story", "prompt": "Write a long essay about the ocean.", "temperature": 0,
         "max_tokens": 64, "stream": True}
# No token of the vocabulary can satisfy a NUL character.
DEAD_AT_START = r"root ::= [\x00]"
DEAD_AFTER_HELLO = 'root ::= "Hello" [\\x00]'


async def solo(daemon: Daemon, request: dict[str, Any]) -> list[dict[str, Any]]:
    async with daemon.client() as client:
        return await client.request(request, 120)


async def beside_a_story(daemon: Daemon, hostile: dict[str, Any]) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]]]:
    """Start the story, send `hostile` on another connection while it streams; both
    replies."""
    story, other = await daemon.connect(), await daemon.connect()
    try:
        first = await story.start_streaming(STORY)
        hostile_reply = await other.request(hostile, 120)
        rest = await story.reply(120)
        return [first, *rest], hostile_reply
    finally:
        await story.close()
        await other.close()


async def assert_story_intact(daemon: Daemon, lines: list[dict[str, Any]],
                              alone: list[dict[str, Any]]) -> None:
    done = done_of(lines)
    assert done["finish_reason"] == "length", lines[-1]
    assert done["usage"]["completion_tokens"] == 64
    assert tokens_text(lines) == tokens_text(alone)
    # Its cache survived the other request's failure: the same prompt is a hit.
    again = done_of(await solo(daemon, {**STORY, "id": "again", "max_tokens": 1}))
    assert again["usage"]["cached_tokens"] > 0, again


async def test_a_grammar_that_admits_nothing_fails_alone_as_invalid_request() -> None:
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        alone = await solo(daemon, STORY)
        story, hostile = await beside_a_story(
            daemon, {"id": "dead", "prompt": "x", "grammar": DEAD_AT_START, "max_tokens": 5})
        assert hostile == [{"id": "dead", "type": "error", "code": "invalid_request",
                            "message": hostile[0]["message"]}], hostile
        assert "at its start" in hostile[0]["message"]
        assert "$.grammar" in hostile[0]["message"]
        await assert_story_intact(daemon, story, alone)
        assert "Traceback" not in daemon.log


async def test_a_grammar_dead_end_mid_document_is_its_own_error_code() -> None:
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        alone = await solo(daemon, STORY)
        story, hostile = await beside_a_story(
            daemon, {"id": "mid", "prompt": "Say hello.", "grammar": DEAD_AFTER_HELLO,
                     "max_tokens": 8, "stream": True})
        final = hostile[-1]
        assert final["type"] == "error" and final["code"] == "grammar_dead_end", hostile
        # What was accepted before the dead end was streamed.
        assert tokens_text(hostile[:-1]) == "Hello", hostile
        await assert_story_intact(daemon, story, alone)
        async with daemon.client() as client:
            stats = await client.final({"op": "stats"})
        assert stats["errors"]["grammar_dead_end"] == 1, stats["errors"]


async def test_a_schema_the_converter_chokes_on_is_invalid_request_and_the_connection_lives(
) -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        bad = {"id": "bad", "prompt": "x",
               "json_schema": {"type": "string", "pattern": "^?$"}}
        # Pipelined: the request behind the bad one must be answered too, in order.
        await client.send(bad, {"id": "after", "op": "health"})
        first = await client.recv(60)
        second = await client.recv(60)
        assert first is not None and second is not None
        assert first["id"] == "bad" and first["code"] == "invalid_request", first
        assert "$.json_schema" in first["message"]
        assert second["id"] == "after" and second["type"] == "health", second
        assert "Traceback" not in daemon.log
