"""Speculative decoding: drafts from a sequence's own text, verified in the shared step.

The pure drafter is tested alone; everything else runs the real daemon on its socket.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/engine/test_speculative.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.kit import Daemon, done_of, merge, running_daemon, tokens_text
from tests.kit.faults import health, poll_until
from tests.kit.prompts import COPY_CODE, COPY_JSON, FREE, RECORD_SCHEMA

# Outputs compared across requests come from one slot: with several, a request's cells
# land among the cells other slots keep, which changes the order attention sums in and
# can flip a near-tie with or without speculation (docs/protocol.md, cache_prompt).
ONE_SLOT = {"server": {"slots": 1}}

# Marked one by one: the drafter tests above are plain functions.
pytest_asyncio_mark = pytest.mark.asyncio


async def generate(daemon: Daemon, request: dict[str, Any], **options: Any) -> dict[str, Any]:
    async with daemon.client() as client:
        lines = await client.request({"temperature": 0, "cache_prompt": False, "stream": False,
                                      **request, **options}, timeout=180)
    return done_of(lines)


async def generate_at_once(daemon: Daemon, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Greedy, each on a connection of its own, all sent before any answer is read."""
    clients = [await daemon.connect() for _ in requests]
    try:
        for client, request in zip(clients, requests, strict=True):
            await client.send({"temperature": 0, "stream": False, **request})
        return [done_of(await client.reply(240)) for client in clients]
    finally:
        for client in clients:
            await client.close()


async def stats(daemon: Daemon) -> dict[str, Any]:
    async with daemon.client() as client:
        return await client.final({"op": "stats"})


@pytest_asyncio_mark
async def test_greedy_with_speculation_equals_greedy_without() -> None:
    # One slot: every request's cells land where the one before it had them, so
    # only speculation differs between the runs (see ONE_SLOT). The row-invariant
    # kernels compute a verified row bit for bit as a lone row, so any difference is a
    # wrong acceptance or a wrong cell, not numerics. (Without them a step of several
    # rows rounds otherwise, and a near-tie such as "dataclasses" in COPY_CODE can go
    # the other way: docs/performance/speculative.md, Numerics.)
    exact = merge(ONE_SLOT, {"speculative": {"draft_max": 2, "draft_start": 2},
                             "model": {"reproducible": True}})
    async with running_daemon(exact) as daemon:
        drafted = accepted = 0
        for request, tokens in ((COPY_CODE, 96), (COPY_JSON, 48), (FREE, 64)):
            plain = await generate(daemon, request, max_tokens=tokens, speculative=False)
            fast = await generate(daemon, request, max_tokens=tokens)
            assert fast["text"] == plain["text"]
            assert plain["usage"]["drafted_tokens"] == 0
            assert fast["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
            assert 0 < fast["usage"]["accepted_tokens"] <= fast["usage"]["drafted_tokens"]
            drafted += fast["usage"]["drafted_tokens"]
            accepted += fast["usage"]["accepted_tokens"]
        counts = (await stats(daemon))["speculative"]
        assert {key: counts[key] for key in ("requests", "drafted", "accepted")} == {
            "requests": 3, "drafted": drafted, "accepted": accepted}


@pytest_asyncio_mark
async def test_every_verifying_step_has_a_whole_multiple_of_logit_rows() -> None:
    # row_multiple 4 (the default): a draft is cut or grown so that its step's logit
    # rows (each sequence's pending token plus the drafts) are a multiple of 4. Only a
    # draft that can neither grow nor shrink stays as is: 2 tokens (3 rows) with no
    # room left before max_tokens, at most one such step per request.
    for slots in (1, 2):
        async with running_daemon({"server": {"slots": slots}}) as daemon:
            requests = [{**COPY_CODE, "id": "code", "max_tokens": 96},
                        {**COPY_JSON, "id": "json", "max_tokens": 64}][:slots]
            dones = await generate_at_once(daemon, requests)
            counts = (await stats(daemon))["speculative"]
        assert all(done["usage"]["accepted_tokens"] > 0 for done in dones)
        assert counts["steps"] >= 4, counts
        assert counts["aligned_steps"] >= counts["steps"] - slots, counts


@pytest_asyncio_mark
async def test_prompts_read_to_their_end_beside_drafts_count_in_the_alignment() -> None:
    # One-token requests, three at a time, while a copy drafts in another slot:
    # each one's prompt ends in a step beside the copy's draft, and its last row asks
    # for logits too. The daemon counts a verifying step's logit rows from the batch
    # it submits (the logits flags), not from its plan: those rows must still come to
    # a multiple of 4. Only the copy drafts, so at most one step may stay as drafted
    # (2 tokens, 3 rows, no room left before max_tokens).
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        copier = await daemon.connect()
        try:
            await copier.start_streaming({**COPY_CODE, "temperature": 0, "max_tokens": 400,
                                          "stream": True})
            copying = asyncio.ensure_future(copier.reply(240))

            async def one_token_requests(number: int) -> int:
                sent = 0
                async with daemon.client() as client:
                    while not copying.done() and sent < 200:
                        done = done_of(await client.request(
                            {"prompt": f"Say {number} {sent}", "max_tokens": 1,
                             "temperature": 0, "stream": False, "speculative": False}))
                        assert done["usage"]["completion_tokens"] <= 1
                        sent += 1
                return sent

            shorts = sum(await asyncio.gather(*(one_token_requests(i) for i in range(3))))
            copied = done_of(await copying)
        finally:
            await copier.close()
        counts = (await stats(daemon))["speculative"]
    assert copied["usage"]["accepted_tokens"] > 0 and shorts >= 8, (copied, shorts)
    assert counts["steps"] >= 8, counts
    assert counts["aligned_steps"] >= counts["steps"] - 1, counts
    # Each verifying step had a pending token and a draft of two or more.
    assert counts["logit_rows"] >= 3 * counts["steps"], counts


@pytest_asyncio_mark
async def test_seeded_sampling_with_speculation_gives_the_same_bytes_twice() -> None:
    # Not the bytes of a run without speculation: llama.cpp computes a row decoded
    # beside others through other kernels than a lone row (logits up to 0.4 apart
    # here), and at temperature 0.8 that moves a draw within a few dozen tokens. The
    # draws themselves are the same: one per emitted token. (The default keeps no
    # store of earlier answers, so the second run drafts exactly as the first.)
    async with running_daemon(ONE_SLOT) as daemon:
        sampled = {"temperature": 0.8, "seed": 1234, "max_tokens": 64}
        first = await generate(daemon, COPY_CODE, **sampled)
        second = await generate(daemon, COPY_CODE, **sampled)
    assert first["text"] == second["text"]
    assert first["usage"] == second["usage"]
    assert first["usage"]["accepted_tokens"] > 0


@pytest_asyncio_mark
async def test_with_a_store_a_request_sent_again_drafts_from_its_earlier_answer() -> None:
    # A prompt with nothing to copy, so the sequence's own text has no match at its
    # first generating step. With max_tokens 4 that step may draft two tokens: only
    # the store can propose them (the first run's answer), and both are accepted.
    # Three rows are verified through the same kernels as one (llama.cpp switches
    # kernels from 4 rows up on this CPU), so the draws are exactly the first run's.
    for store_tokens, drafted in ((4096, 2), (0, 0)):
        config = {**ONE_SLOT, "speculative": {"store_tokens": store_tokens}}
        async with running_daemon(config) as daemon:
            first = await generate(daemon, FREE, max_tokens=48)
            second = await generate(daemon, FREE, max_tokens=4)
        assert second["text"] == first["text"][:len(second["text"])]
        assert (second["usage"]["drafted_tokens"], second["usage"]["accepted_tokens"]) == (
            drafted, drafted), store_tokens


@pytest_asyncio_mark
async def test_max_tokens_inside_an_accepted_draft_is_never_exceeded() -> None:
    async with running_daemon() as daemon:
        whole = await generate(daemon, COPY_CODE, max_tokens=64)
        assert whole["usage"]["accepted_tokens"] >= 16
        for limit in (2, 3, 5, 9, 17, 33):
            done = await generate(daemon, COPY_CODE, max_tokens=limit)
            assert done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == limit
            assert whole["text"].startswith(done["text"]), (limit, done["text"])


@pytest_asyncio_mark
async def test_a_stop_sequence_inside_an_accepted_draft_cuts_there() -> None:
    async with running_daemon() as daemon:
        whole = await generate(daemon, COPY_CODE, max_tokens=96)
        stop = "import dataclass"  # copied from the prompt, so drafted and accepted
        assert stop in whole["text"] and whole["usage"]["accepted_tokens"] > 0
        async with daemon.client() as client:
            lines = await client.request({**COPY_CODE, "temperature": 0, "cache_prompt": False,
                                          "max_tokens": 96, "stop": stop}, timeout=180)
        done = done_of(lines)
        assert done["finish_reason"] == "stop_sequence" and done["stop_sequence"] == stop
        assert tokens_text(lines) == whole["text"][:whole["text"].index(stop)]
        assert done["usage"]["accepted_tokens"] > 0


@pytest_asyncio_mark
async def test_cancel_and_disconnect_in_the_middle_of_speculative_streams() -> None:
    # Room for replies long enough to outlast the test at any speed: a small model
    # repeating itself is drafted and accepted dozens of tokens a step.
    async with running_daemon({"server": {"slots": 2}, "model": {"n_ctx": 32768}}) as daemon:
        endless = {**FREE, "temperature": 0, "max_tokens": 16000}
        async with daemon.client() as client:
            await client.start_streaming({**endless, "id": "c"})
            leaving = await daemon.connect()
            await leaving.start_streaming({**endless, "id": "d"})
            await leaving.close()  # gone in the middle of a stream
            await client.send({"op": "cancel", "target": "c"})
            lines = await client.reply(120)
            done = next(line for line in lines if line["type"] == "done")
            assert done["finish_reason"] == "cancelled"
            assert done["usage"]["completion_tokens"] < 16000
        await poll_until(lambda: health(daemon), lambda state: state["slots_busy"] == 0,
                         timeout=60, what="both slots free")
        after = await generate(daemon, COPY_JSON, max_tokens=8)
        assert after["usage"]["completion_tokens"] == 8


@pytest_asyncio_mark
async def test_four_slots_two_speculating_two_not_and_every_cell_accounted() -> None:
    async with running_daemon({"server": {"slots": 4}}) as daemon:
        requests = [
            {**COPY_CODE, "id": "a", "max_tokens": 80},
            {**COPY_CODE, "id": "b", "max_tokens": 80, "speculative": False},
            {**COPY_JSON, "id": "c", "max_tokens": 48},
            {**COPY_JSON, "id": "d", "max_tokens": 48, "speculative": False},
        ]
        dones = await generate_at_once(daemon, requests)
        by_id = {done["id"]: done for done in dones}
        for done in dones:
            assert done["finish_reason"] in ("length", "stop"), done
        assert by_id["a"]["usage"]["accepted_tokens"] > 0
        assert by_id["c"]["usage"]["accepted_tokens"] > 0
        assert by_id["b"]["usage"]["drafted_tokens"] == by_id["d"]["usage"]["drafted_tokens"] == 0
        counts = (await stats(daemon))["speculative"]
        assert counts["drafted"] == sum(done["usage"]["drafted_tokens"] for done in dones)
        assert counts["accepted"] == sum(done["usage"]["accepted_tokens"] for done in dones)
        # Each idle slot holds exactly the tokens its request emitted (but the last,
        # never decoded): rejected draft cells were removed, not kept.
        slots = (await stats(daemon))["slots"]
        held = sorted(slot["cached_tokens"] for slot in slots)
        expected = sorted(done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"] - 1
                          for done in dones)
        assert held == expected
        # And a follow-up with the same prompt reuses all of it but the last token.
        again = await generate(daemon, COPY_CODE, max_tokens=4, cache_prompt=True)
        assert again["usage"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


@pytest_asyncio_mark
async def test_a_grammar_request_speculates_and_stays_valid_json() -> None:
    async with running_daemon() as daemon:
        done = await generate(daemon, COPY_JSON, max_tokens=96, json_schema=RECORD_SCHEMA)
        document = json.loads(done["text"])
        assert set(document) == {"name", "born", "fields"}
        assert isinstance(document["born"], int)
        assert done["usage"]["accepted_tokens"] > 0
        counts = (await stats(daemon))
        assert counts["speculative"]["accepted"] == done["usage"]["accepted_tokens"]
        assert counts["grammar"]["requests"] == 1


@pytest_asyncio_mark
async def test_speculation_is_reported_and_can_be_refused() -> None:
    async with running_daemon() as daemon:
        async with daemon.client() as client:
            info = await client.final({"op": "info"})
            assert info["config"]["speculative"] == {
                "mode": "ngram", "draft_max": 64, "draft_start": 4, "ngram_max": 4,
                "ngram_min": 2, "store_tokens": 0, "row_multiple": 4, "policy": "always",
                "step_costs": None}
            bad = await client.final({"id": "x", "prompt": "hi", "speculative": "yes"})
            assert bad["type"] == "error" and bad["code"] == "invalid_request"
            assert "speculative" in bad["message"] and bad["id"] == "x"
            assert (await client.final({"op": "health"}))["status"] == "ok"
    # Reproducible mode drafts too: its verified rows are lone rows' to the bit.
    async with running_daemon({"model": {"reproducible": True}}) as daemon:
        async with daemon.client() as client:
            info = await client.final({"op": "info"})
        assert info["config"]["speculative"]["mode"] == "ngram"
        done = await generate(daemon, COPY_JSON, max_tokens=32)
        assert done["usage"]["accepted_tokens"] > 0


@pytest_asyncio_mark
async def test_speculation_off_in_the_config_never_drafts() -> None:
    # With no draft rows the context's output rows are the slots' and the prompt store's
    # spare sequence ids: llama.cpp asserts at start-up if there are fewer.
    async with running_daemon({"speculative": {"mode": "off"}}) as daemon:
        done = await generate(daemon, COPY_CODE, max_tokens=24)
        assert done["usage"]["completion_tokens"] == 24
        assert done["usage"]["drafted_tokens"] == 0
        assert (await stats(daemon))["speculative"]["drafted"] == 0
