"""One request's failure is that request's alone (issue 15).

With parallel slots one llama_decode serves every client; these tests run a
well-behaved stream beside a request that fails in the middle of the shared step
and check that only the failing request ends, with its own specific error.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.kit import Daemon, done_of, running_daemon, tokens_text
from tests.kit.faults import health, poll_until

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


ENDLESS = {"grammar": "root ::= [a-z ] root", "temperature": 0}


async def test_a_large_waiting_request_does_not_hold_up_small_ones_behind_it() -> None:
    # A 4096-cell pool: the running request reserves about 2000 cells, so a request that
    # asks for 3000 tokens must wait; a small one behind it fits and starts at once.
    async with running_daemon({"server": {"slots": 3}}) as daemon:
        runner, large, small = [await daemon.connect() for _ in range(3)]
        try:
            await runner.start_streaming({"id": "runner", "prompt": "Write.", **ENDLESS,
                                          "max_tokens": 2000})
            await large.send({"id": "large", "prompt": "Write.", "max_tokens": 3000})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the large request waiting")
            done = done_of(await small.request(
                {"id": "small", "prompt": "Hi", "max_tokens": 4}, 120))
            assert done["usage"]["completion_tokens"] == 4
            async with daemon.client() as watcher:
                state = await watcher.final({"op": "health"})
            # The large one still waits, and the runner still runs.
            assert state["queue_depth"] == 1 and state["slots_busy"] == 1, state
            # Cancelling the waiting head answers it at once.
            await large.send({"op": "cancel", "target": "large"})
            cancelled = await large.reply(60)
            assert done_of(cancelled)["finish_reason"] == "cancelled"
            await runner.send({"op": "cancel", "target": "runner"})
            assert done_of(await runner.reply(60))["finish_reason"] == "cancelled"
        finally:
            for client in (runner, large, small):
                await client.close()


@pytest.mark.parametrize("goes", ["cancelled", "hung up"])
async def test_a_head_overtaken_to_its_limit_holds_the_queue_until_it_goes(goes: str) -> None:
    # As above; eight small requests overtake the large one, the ninth must wait behind
    # it (a large request is not starved). Cancelling the large one, or its client
    # hanging up, starts the ninth at once, while the runner still runs.
    async with running_daemon({"server": {"slots": 3}}) as daemon:
        runner, large, small = [await daemon.connect() for _ in range(3)]
        try:
            await runner.start_streaming({"id": "runner", "prompt": "Write.", **ENDLESS,
                                          "max_tokens": 2000})
            await large.send({"id": "large", "prompt": "Write.", "max_tokens": 3000})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the large request waiting")
            for index in range(8):
                done = done_of(await small.request(
                    {"id": f"small{index}", "prompt": "Hi", "max_tokens": 2}, 120))
                assert done["usage"]["completion_tokens"] == 2
            await small.send({"id": "ninth", "prompt": "Hi", "max_tokens": 2})
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 2,
                             timeout=30, what="the ninth request waiting behind the large one")
            if goes == "cancelled":
                await large.send({"op": "cancel", "target": "large"})
                assert done_of(await large.reply(60))["finish_reason"] == "cancelled"
            else:
                await large.close()
            done = done_of(await small.reply(60))
            assert done["id"] == "ninth" and done["usage"]["completion_tokens"] == 2
            await runner.send({"op": "cancel", "target": "runner"})
            # The runner ran throughout: it ends by the cancel, not by its 2000 tokens.
            assert done_of(await runner.reply(60))["finish_reason"] == "cancelled"
        finally:
            for client in (runner, large, small):
                await client.close()


async def test_a_reading_client_gets_a_reply_larger_than_the_output_limit() -> None:
    # 600 KB of text, one token per byte: its token list is 4.8 MB of JSON, far more
    # than the default max_output_buffer_bytes (1 MiB), in one write.
    text = "7 " * 300_000
    async with running_daemon({"model": {"n_ctx": 512}}) as daemon, daemon.client() as client:
        reply = await client.final({"id": "big", "op": "tokenize", "text": text}, 120)
        assert reply["type"] == "tokens" and len(reply["tokens"]) > 500_000, reply.get("type")
        # Several replies held behind a slow one, then flushed at once, are read too.
        await client.send({"id": "slow", "prompt": "Hi", "max_tokens": 8},
                          *({"id": f"t{i}", "op": "tokenize", "text": text[:100_000]}
                            for i in range(4)))
        lines = [await client.recv(120) for _ in range(5)]
        finals = [line for line in lines if line is not None and line["type"] != "token"]
        while len(finals) < 5:
            line = await client.recv(120)
            assert line is not None, finals
            if line["type"] != "token":
                finals.append(line)
        assert [line["id"] for line in finals] == ["slow", "t0", "t1", "t2", "t3"], finals


async def test_a_grammar_the_model_keeps_missing_ends_at_its_budget_alone() -> None:
    # Control bytes in an order no model predicts: the first token, at least, is found
    # only by a pass over the whole vocabulary (about 0.1 s on the default model).
    literal = "".join(f"\\x{byte:02x}" for byte in [3, 7, 1, 5, 2, 8, 4, 6] * 4)
    hostile = {"id": "rare", "prompt": "Write about the sea.", "grammar": f'root ::= "{literal}"',
               "max_tokens": 40, "temperature": 0, "stream": False}
    async with running_daemon({"server": {"slots": 2, "grammar_budget_s": 0.001}}) as daemon:
        alone = await solo(daemon, STORY)
        story, reply = await beside_a_story(daemon, hostile)
        assert reply[-1]["type"] == "error", reply
        assert reply[-1]["code"] == "grammar_dead_end", reply
        assert "grammar_budget_s" in reply[-1]["message"], reply
        await assert_story_intact(daemon, story, alone)
    # Within the default budget the same request completes.
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        done = done_of(await solo(daemon, hostile))
        assert done["text"] == "".join(chr(byte) for byte in [3, 7, 1, 5, 2, 8, 4, 6] * 4), done


async def test_a_grammar_never_takes_a_control_token_for_its_text() -> None:
    # Gemma's <start_of_turn> and <end_of_turn> are control tokens whose special text
    # the grammar's literal matches; the daemon streams control tokens as nothing, so
    # taking one would drop the literal from the output. It is spelled out instead.
    prompt = "<start_of_turn>user\nHi<end_of_turn>\n"
    async with running_daemon({"server": {"slots": 1}}) as daemon, \
            daemon.client() as client:
        for marker in ("<start_of_turn>", "<end_of_turn>"):
            done = done_of(await client.request(
                {"prompt": prompt, "grammar": f'root ::= "{marker}" [a-z]{{3}}',
                 "max_tokens": 30, "temperature": 0, "stream": False}, 120))
            assert done["text"].startswith(marker) and len(done["text"]) == len(marker) + 3, done
