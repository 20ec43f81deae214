"""Parallel slots: concurrent requests decoded together, each keeping its own meaning.

Every test runs the real daemon with `slots > 1` and talks to it over its socket.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from typing import Any

import pytest

from tests.kit import Client, Daemon, done_of, running_daemon, tokens_text
from tests.kit.faults import health, poll_until

pytestmark = pytest.mark.asyncio

# A grammar that never completes: such a request runs until cancelled (or max_tokens).
ENDLESS_GRAMMAR = "root ::= [a-z ] root"
TOPICS = ("the ocean", "a desert", "old forests", "a mountain pass", "rivers", "volcanoes",
          "glaciers", "the prairie")


def story(index: int, **options: Any) -> dict[str, Any]:
    return {"id": f"s{index}", "prompt": f"Write a long essay about {TOPICS[index]}.",
            "temperature": 0, "max_tokens": 48, **options}


async def stream_all(daemon: Daemon, requests: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Send each request on its own connection at once; every reply, in request order."""
    clients = [await daemon.connect() for _ in requests]
    try:
        for client, request in zip(clients, requests, strict=True):
            await client.send(request)
        return list(await asyncio.gather(*(client.reply(120) for client in clients)))
    finally:
        for client in clients:
            await client.close()


async def first_tokens(clients: list[Client], requests: list[dict[str, Any]]) -> None:
    for client, request in zip(clients, requests, strict=True):
        await client.start_streaming(request)


async def test_four_clients_run_at_once_and_each_gets_its_own_answer() -> None:
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        # One token a step: with drafts a repetitive story can finish its 64 tokens
        # in a few steps, before the last client has sent its request.
        requests = [story(i, max_tokens=64, speculative=False) for i in range(4)]
        clients = [await daemon.connect() for _ in requests]
        try:
            # Each has streamed its first token before any has finished: all four
            # are being decoded, not queued behind each other.
            await first_tokens(clients, requests)
            state = await health(daemon)
            assert state["slots"] == 4
            assert state["slots_busy"] == 4 and state["queue_depth"] == 0, state
            replies = [await client.reply(120) for client in clients]
        finally:
            for client in clients:
                await client.close()
        for request, lines in zip(requests, replies, strict=True):
            done = done_of(lines)
            assert all(line["id"] == request["id"] for line in lines)
            assert done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 64
        texts = {tokens_text(lines) for lines in replies}
        assert len(texts) == 4, "distinct prompts gave the same text"
        async with daemon.client() as client:
            stats = await client.final({"op": "stats"})
            info = await client.final({"op": "info"})
        assert info["config"]["slots"] == 4
        assert [slot["slot"] for slot in stats["slots"]] == [0, 1, 2, 3]
        assert sum(slot["requests"] for slot in stats["slots"]) == 4
        assert all(slot["requests"] == 1 and not slot["busy"] for slot in stats["slots"])


async def test_a_fifth_request_waits_for_a_free_slot() -> None:
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        requests = [story(i, max_tokens=40) for i in range(3)]
        clients = [await daemon.connect() for _ in requests]
        try:
            await first_tokens(clients[:2], requests[:2])
            await clients[2].send(requests[2])
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the third request queued")
            replies = [await client.reply(120) for client in clients]
        finally:
            for client in clients:
                await client.close()
        for lines in replies:
            assert done_of(lines)["usage"]["completion_tokens"] == 40
        # It started only when one of the first two ended: it was sent once both had
        # streamed a token, so it waited about as long as one decoded its other 39.
        first_two = [done_of(lines)["timings"] for lines in replies[:2]]
        queued = done_of(replies[2])["timings"]["queued_ms"]
        assert queued > 0.5 * min(t["decode_ms"] for t in first_two), (queued, first_two)
        # The first two waited at most for a step in progress (their slots were free):
        # less than the third, whatever the load (a loaded run saw 2.2 s against 9.3 s).
        assert queued > max(t["queued_ms"] for t in first_two), (queued, first_two)


async def test_cancel_and_disconnect_end_one_sequence_and_never_disturb_the_others() -> None:
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        requests = [story(i, max_tokens=2000 if i < 2 else 60) for i in range(4)]
        clients = [await daemon.connect() for _ in requests]
        try:
            await first_tokens(clients, requests)
            # Client 0 cancels its request over the same connection.
            await clients[0].send({"op": "cancel", "id": "c", "target": "s0"})
            # Client 1 vanishes mid-stream.
            await clients[1].close()
            cancelled = await clients[0].reply(60)
            assert done_of(cancelled)["finish_reason"] == "cancelled"
            assert (await clients[0].reply(30))[-1] == {
                "id": "c", "type": "cancelled", "target": "s0", "found": True}
            others = [await client.reply(120) for client in clients[2:]]
        finally:
            for client in clients:
                await client.close()
        for lines in others:
            done = done_of(lines)
            assert done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 60
        await poll_until(lambda: health(daemon), lambda h: h["slots_busy"] == 0,
                         timeout=10, what="every slot free")


async def test_stop_sequences_apply_to_their_own_sequence_only() -> None:
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        # A stop both texts are sure to reach: an essay's first sentence ends. (A word
        # picked from a solo run could be moved by batched numerics and never show up.)
        stop = "."
        replies = await stream_all(daemon, [
            {**story(0, max_tokens=40), "stop": [stop]}, story(1, max_tokens=40)])
        stopped, free = done_of(replies[0]), done_of(replies[1])
        assert stopped["finish_reason"] == "stop_sequence", stopped
        assert stopped["stop_sequence"] == stop
        text = tokens_text(replies[0])
        assert text.strip() and stop not in text, text
        # The other sequence ignores it: its text goes through the stop, to its length.
        assert free["finish_reason"] == "length"
        assert free["usage"]["completion_tokens"] == 40
        assert stop in tokens_text(replies[1])


async def test_pipelined_requests_on_one_connection_answer_in_order_yet_run_together() -> None:
    async with running_daemon({"server": {"slots": 2}}) as daemon, daemon.client() as client:
        await client.send(story(0, max_tokens=60), story(1, max_tokens=3))
        long_reply = await client.reply(120)
        short_reply = await client.reply(120)
        assert {line["id"] for line in long_reply} == {"s0"}
        assert {line["id"] for line in short_reply} == {"s1"}
        long_done, short_done = done_of(long_reply), done_of(short_reply)
        assert short_done["usage"]["completion_tokens"] == 3
        # The short one ran beside the long one: it did not wait for it to finish.
        assert short_done["timings"]["queued_ms"] < long_done["timings"]["total_ms"] / 2


async def test_a_long_prompt_is_read_in_chunks_while_another_streams() -> None:
    config = {"server": {"slots": 2, "prefill_per_step": 32}}
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 180  # ~1800 tokens
    async with running_daemon(config) as daemon:
        streamer, reader = await daemon.connect(), await daemon.connect()
        try:
            await streamer.start_streaming(story(0, max_tokens=80))
            await reader.send({"id": "long", "prompt": long_prompt, "max_tokens": 4,
                               "temperature": 0})
            streamed = await streamer.reply(180)
            long_done = done_of(await reader.reply(180))
        finally:
            await streamer.close()
            await reader.close()
        assert done_of(streamed)["usage"]["completion_tokens"] == 80
        assert long_done["usage"]["prompt_tokens"] > 1500
        assert long_done["usage"]["completion_tokens"] == 4


async def test_beside_a_stream_a_long_prompt_takes_the_rows_its_measured_costs_give() -> None:
    # prefill_per_step 0: the step costs measured at start-up size the chunks.
    config = {"server": {"slots": 2, "prefill_per_step": 0}}
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens
    async with running_daemon(config) as daemon, daemon.client() as counter:
        found = re.search(r"prompt rows a step beside one stream: (\d+), (\d+) at depth",
                          daemon.log)
        assert found is not None, daemon.log[-3000:]
        shallow, deep = int(found.group(1)), int(found.group(2))
        assert 1 <= deep <= shallow
        streamer, reader = await daemon.connect(), await daemon.connect()
        try:
            await streamer.start_streaming(story(0, grammar=ENDLESS_GRAMMAR, max_tokens=3000,
                                                 speculative=False))
            before = await decode_steps(counter)
            await reader.send({"id": "long", "prompt": long_prompt, "max_tokens": 1,
                               "temperature": 0, "cache_prompt": False})
            long_done = done_of(await reader.reply(180))
            steps = await decode_steps(counter) - before
            await streamer.send({"op": "cancel", "id": "c", "target": "s0"})
            stream_done = done_of(await streamer.reply(60))
            assert stream_done["finish_reason"] == "cancelled", stream_done["usage"]
        finally:
            await streamer.close()
            await reader.close()
    prompt_tokens = long_done["usage"]["prompt_tokens"]
    assert prompt_tokens > 500
    # Each step read at most about `shallow` rows of it (the stream's own depth adds a
    # little to its rows' cost): in whole chunks or 64 a step it would take a few steps.
    assert steps >= prompt_tokens / (2 * shallow + 2), (steps, shallow)


async def test_a_request_waits_until_its_context_fits_instead_of_failing() -> None:
    # A 1024-cell pool: the first request reserves its prompt plus 900 tokens, so the
    # second (prompt plus 300) cannot fit beside it and must wait, not fail.
    config = {"server": {"slots": 2}, "model": {"n_ctx": 1024}}
    async with running_daemon(config) as daemon:
        big, small = await daemon.connect(), await daemon.connect()
        try:
            await big.start_streaming(story(0, max_tokens=900))
            await small.send(story(1, max_tokens=300))
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the second request waiting for room")
            assert (await health(daemon))["slots_busy"] == 1
            await big.send({"op": "cancel", "id": "c", "target": "s0"})
            assert done_of(await big.reply(60))["finish_reason"] == "cancelled"
            done = done_of(await small.reply(120))
        finally:
            await big.close()
            await small.close()
        assert done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 300


async def test_a_prompt_goes_to_the_slot_that_caches_its_prefix() -> None:
    prefix = " ".join(f"Fact {i}: item {i} weighs {i * 3} grams." for i in range(60))
    async with running_daemon({"server": {"slots": 3}}) as daemon, daemon.client() as client:
        first = done_of(await client.request(
            {"prompt": prefix + "\nQ: which item is heaviest?\nA:", "max_tokens": 8,
             "temperature": 0}))
        for index in range(2):  # two unrelated requests take the other slots
            await client.request(story(index, max_tokens=4))
        again = done_of(await client.request(
            {"prompt": prefix + "\nQ: how many items?\nA:", "max_tokens": 8,
             "temperature": 0}))
        assert again["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16
        stats = await client.final({"op": "stats"})
        assert sorted(slot["requests"] for slot in stats["slots"]) == [1, 1, 2]


async def test_a_cold_request_runs_beside_others_and_leaves_their_caches_alone() -> None:
    seeded = {"id": "x", "prompt": "Once upon a time in a small village,", "max_tokens": 48,
              "temperature": 0.9, "seed": 11, "cache_prompt": False}
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        async with daemon.client() as client:
            alone = tokens_text(await client.request(seeded))
            again = done_of(await client.request(seeded))
        # Alone, a cold seeded request gives the same bytes every time, reusing nothing.
        assert again["usage"]["cached_tokens"] == 0
        async with daemon.client() as client:
            assert tokens_text(await client.request(seeded)) == alone
        async with daemon.client() as busy, daemon.client() as cold:
            # Runs beside a request that cannot end before it is cancelled: it does not
            # wait for the batch to empty.
            await busy.start_streaming({**story(0, max_tokens=1500), "id": "busy",
                                        "grammar": ENDLESS_GRAMMAR})
            done = done_of(await cold.request(seeded, timeout=120))
            assert done["usage"]["completion_tokens"] == 48
            state = await health(daemon)
            assert state["slots_busy"] == 1, state
            await busy.send({"op": "cancel", "target": "busy"})
            await busy.reply(60)
        # The busy slot's cache survived the cold request.
        async with daemon.client() as client:
            slots = (await client.final({"op": "stats"}))["slots"]
        assert max(slot["cached_tokens"] for slot in slots) > 48, slots


async def test_reproducible_mode_equals_a_cold_solo_run_beside_other_requests() -> None:
    config = {"server": {"slots": 4}, "model": {"reproducible": True}}
    target = {"id": "t", "prompt": "The history of the city of Lyon begins", "max_tokens": 64,
              "temperature": 0}
    async with running_daemon(config) as daemon:
        async with daemon.client() as client:
            cold = tokens_text(await client.request(target))
    async with running_daemon(config) as daemon:
        replies = await stream_all(daemon, [story(i, max_tokens=64) for i in range(3)]
                                   + [target])
        assert tokens_text(replies[-1]) == cold
        # And again, with the other slots' caches full of other prompts.
        replies = await stream_all(daemon, [target] + [story(i, max_tokens=16)
                                                       for i in range(3, 6)])
        assert tokens_text(replies[0]) == cold


async def test_one_slot_still_serves_one_request_at_a_time() -> None:
    async with running_daemon({"server": {"slots": 1}}) as daemon:
        clients = [await daemon.connect() for _ in range(2)]
        try:
            await clients[0].start_streaming(story(0, max_tokens=30))
            await clients[1].send(story(1, max_tokens=5))
            await poll_until(lambda: health(daemon), lambda h: h["queue_depth"] == 1,
                             timeout=30, what="the second request queued behind the first")
            first = done_of(await clients[0].reply(120))
            second = done_of(await clients[1].reply(120))
        finally:
            for client in clients:
                await client.close()
        assert first["usage"]["completion_tokens"] == 30
        # Sent once the first had streamed a token: it waited for the other 29.
        assert second["timings"]["queued_ms"] > 0.5 * first["timings"]["decode_ms"], (
            first["timings"], second["timings"])
        assert (await health(daemon))["slots"] == 1


async def test_a_prefix_another_slot_is_using_is_shared_not_evaluated_again() -> None:
    system = " ".join(f"Rule {i}: answer politely about topic {i}." for i in range(50))
    borrower = {"id": "b", "prompt": system + "\nUser: hello\nBot:", "max_tokens": 4,
                "temperature": 0, "stream": False}
    async with running_daemon({"server": {"slots": 2}}) as daemon:
        busy, other = await daemon.connect(), await daemon.connect()
        try:
            # Slot 0 is busy generating after the long system prompt, and cannot finish
            # before it is cancelled (its grammar never completes: no end-of-generation)...
            await busy.start_streaming({"id": "a", "prompt": system + "\nUser: hi\nBot:",
                                        "max_tokens": 1500, "temperature": 0,
                                        "grammar": ENDLESS_GRAMMAR})
            # Past the sliding window (512 tokens for Gemma 3): the source slot's early
            # rows must still be there for the borrower to reuse them.
            for _ in range(600):
                line = await busy.recv(60)
                assert line is not None and line["type"] == "token", line
            # ...so this request goes to slot 1 and borrows the running slot's cells.
            done = done_of(await other.request(borrower, timeout=120))
            state = await health(daemon)
            await busy.send({"op": "cancel", "id": "c", "target": "a"})
            await busy.reply(60)
            # The same request evaluated from an empty cache.
            cold = done_of(await other.request({**borrower, "cache_prompt": False},
                                               timeout=120))
        finally:
            await busy.close()
            await other.close()
        assert state["slots_busy"] >= 1, state  # "a" was still running when b finished
        usage = done["usage"]
        assert usage["prompt_tokens"] > 400
        assert usage["prompt_tokens"] - usage["cached_tokens"] < 16, usage
        assert cold["usage"]["cached_tokens"] == 0
        assert done["text"] == cold["text"], (done["text"], cold["text"])


async def test_of_two_prompts_that_arrive_together_the_shorter_gets_its_first_token_first() -> None:
    # Two short cold prompts, pipelined in one write, the shorter first. Read in one
    # step, both would get their first token at its end, and the shorter, which arrived
    # first, would show the longer wait; the step loop reads the shorter in a step of
    # its own (PrefillShare.short_rows), and the longer a step later.
    shorter = {"id": "shorter", "prompt": "Name a colour.", "max_tokens": 2,
               "temperature": 0, "cache_prompt": False}
    longer = {"id": "longer", "max_tokens": 2, "temperature": 0, "cache_prompt": False,
              "prompt": "Here is a list of animals: cat, dog, horse, cow, sheep, goat, pig,"
                        " duck, goose, hen, rabbit, mouse. Which of them can fly?"}
    # prefill_per_step 0: the step costs are measured, and they size the short rests' steps.
    config = {"server": {"slots": 2, "prefill_per_step": 0}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        await client.send(shorter, longer)
        first, second = done_of(await client.reply(120)), done_of(await client.reply(120))
        found = re.search(r"of eight 32-token short rests: (\d+)", daemon.log)
        assert found is not None, daemon.log[-3000:]
    rests = [done["usage"]["prompt_tokens"] - done["usage"]["cached_tokens"]
             for done in (first, second)]
    # Both are short rests, and together more than one step of them holds: the rows a
    # step grow with the root of the rows waiting (256 in the logged figure).
    step_rows = (int(found.group(1)) + 1) * math.sqrt(sum(rests) / 256)
    assert rests[0] < rests[1] <= 64 and sum(rests) > step_rows, (rests, step_rows)
    assert first["timings"]["first_token_ms"] < second["timings"]["first_token_ms"], (
        first["timings"], second["timings"])


async def decode_steps(client: Client) -> int:
    text = (await client.final({"op": "metrics"}))["text"]
    found = re.search(r"^sfcore_decode_steps_total (\S+)$", text, re.MULTILINE)
    assert found is not None, text
    return int(float(found.group(1)))


async def test_a_burst_of_prompts_is_read_together_not_a_few_rows_a_step() -> None:
    # Four 301-token prompts in one write: each begins while the others wait for their first
    # token, so they are one burst, read in whole n_batch chunks beside the burst's streams
    # (25 steps in all), not 4 rows a step beside the first streams (49 steps before).
    words = ["harbor", "lantern", "orchard", "meadow", "copper", "violin", "thunder"]
    requests = [{"id": f"b{index}", "max_tokens": 24, "temperature": 0, "cache_prompt": False,
                 "grammar": ENDLESS_GRAMMAR,
                 "prompt": " ".join(random.Random(index).choices(words, k=300))}
                for index in range(4)]
    config = {"server": {"slots": 4, "prefill_per_step": 4}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        before = await decode_steps(client)
        async with daemon.client() as sender:
            await sender.send(*requests)
            dones = [done_of(await sender.reply(180)) for _ in requests]
        steps = await decode_steps(client) - before
    assert all(done["usage"]["completion_tokens"] == 24 for done in dones), dones
    assert sum(done["usage"]["prompt_tokens"] for done in dones) > 1000
    assert steps <= 36, steps
