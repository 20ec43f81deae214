"""Logprobs (`logprobs: N` on generate and chat): the numbers of a logits row, the entries'
way into the lines, the request field, and the real daemon end to end.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/core/test_logprobs.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.kit import Client, done_of, running_daemon

# One slot, drafts of at most 2 tokens: requests compared with each other compute each
# row as a lone row would (tests/e2e/ndjson/test_speculative.py, ONE_SLOT and the exact test).
CONFIG = {"server": {"slots": 1}, "speculative": {"draft_max": 2, "draft_start": 2}}
# A verified row bit for bit a lone row's (several rows a step round otherwise).
ROW_INVARIANT = {**CONFIG, "model": {"reproducible": True}}
GREEDY = {"prompt": "The three primary colors are", "max_tokens": 32, "temperature": 0,
          "cache_prompt": False}
RECORD = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
COPY = {"op": "chat",
        "messages": [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}],
        "max_tokens": 48, "temperature": 0, "cache_prompt": False}
daemon_test = pytest.mark.asyncio


def check_entries(entries: list[dict[str, Any]], top: int, greedy: bool = True) -> None:
    for entry in entries:
        assert set(entry) == {"token", "text", "bytes", "logprob", "top_logprobs"}
        assert entry["logprob"] <= 0
        assert entry["text"] == bytes(entry["bytes"]).decode("utf-8", "replace")
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == top
        values = [alternative["logprob"] for alternative in alternatives]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        for alternative in alternatives:
            assert alternative["text"] == bytes(alternative["bytes"]).decode("utf-8", "replace")
        if greedy and top:
            assert alternatives[0]["token"] == entry["token"]
            assert alternatives[0]["logprob"] == entry["logprob"]
            assert alternatives[0]["bytes"] == entry["bytes"]


def joined(entries: list[dict[str, Any]]) -> bytes:
    return b"".join(bytes(entry["bytes"]) for entry in entries)


async def whole(client: Client, request: dict[str, Any]) -> dict[str, Any]:
    return done_of(await client.request({**request, "stream": False}, timeout=120))


@daemon_test
async def test_greedy_entries_match_the_text_streamed_or_not() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**GREEDY, "logprobs": 5})
        entries = done["logprobs"]
        check_entries(entries, 5)
        assert len(entries) == done["usage"]["completion_tokens"] == 32
        assert joined(entries) == done["text"].encode()
        lines = await client.request({**GREEDY, "logprobs": 5, "stream": True}, timeout=120)
        tokens = [line for line in lines if line["type"] == "token"]
        assert all(set(line) == {"id", "type", "text", "logprobs"} for line in tokens)
        # Without holdback (no stop, whole characters) each line carries its own token.
        assert all(joined(line["logprobs"]) == line["text"].encode() for line in tokens)
        streamed = [entry for line in tokens for entry in line["logprobs"]]
        assert done_of(lines)["logprobs"] == []
        assert [e["token"] for e in streamed] == [e["token"] for e in entries]
        for one, other in zip(streamed, entries, strict=True):
            assert one["logprob"] == pytest.approx(other["logprob"], abs=1e-4)
        # Asked for none: no key anywhere.
        plain = await client.request({**GREEDY, "stream": True}, timeout=120)
        assert all("logprobs" not in line for line in plain)
        assert "logprobs" not in await whole(client, GREEDY)


@daemon_test
async def test_chat_with_logprobs_0_has_no_alternatives() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**COPY, "logprobs": 0, "speculative": False})
        entries = done["logprobs"]
        check_entries(entries, 0)
        assert len(entries) == done["usage"]["completion_tokens"] > 0
        assert joined(entries) == done["text"].encode()
        sampled = await whole(client, {**COPY, "logprobs": 20, "temperature": 0.8, "seed": 3})
        check_entries(sampled["logprobs"], 20, greedy=False)


@daemon_test
async def test_drafted_tokens_carry_the_numbers_of_the_rows_that_verified_them() -> None:
    async with running_daemon(ROW_INVARIANT) as daemon, daemon.client() as client:
        plain = await whole(client, {**COPY, "logprobs": 3, "speculative": False})
        fast = await whole(client, {**COPY, "logprobs": 3})
        assert plain["usage"]["drafted_tokens"] == 0
        assert fast["usage"]["accepted_tokens"] > 0
        assert fast["text"] == plain["text"]
        check_entries(fast["logprobs"], 3)
        for one, other in zip(fast["logprobs"], plain["logprobs"], strict=True):
            assert one["token"] == other["token"]
            assert one["logprob"] == pytest.approx(other["logprob"], abs=1e-3)
            assert [a["token"] for a in one["top_logprobs"]] == [
                a["token"] for a in other["top_logprobs"]]


@daemon_test
async def test_a_stop_sequence_keeps_the_entries_of_the_text_before_it() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        full = await whole(client, {**GREEDY, "logprobs": 1})
        text = full["text"]
        # A stop sequence that first occurs in the middle of the text.
        middle_first = sorted(range(1, len(text) - 3), key=lambda at: abs(at - len(text) // 2))
        stop = next(text[at:at + 3] for at in middle_first
                    if text.find(text[at:at + 3]) == at and text[at:at + 3].strip())
        cut = await whole(client, {**GREEDY, "logprobs": 1, "stop": stop})
        assert cut["finish_reason"] == "stop_sequence"
        assert cut["text"] == text[:text.find(stop)]
        entries = cut["logprobs"]
        assert 0 < len(entries) <= cut["usage"]["completion_tokens"]
        assert [e["token"] for e in entries] == [e["token"] for e in full["logprobs"]][
            :len(entries)]
        # Each entry's token starts before the cut: the last one's text does too.
        assert joined(entries).startswith(cut["text"].encode())
        assert len(joined(entries[:-1])) < len(cut["text"].encode())


@daemon_test
async def test_out_of_range_logprobs_are_invalid_and_the_daemon_serves_on() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        for value in (21, -1, "x", 2.5, True):
            for request in (GREEDY, COPY):
                reply = await client.final({**request, "id": "bad", "logprobs": value})
                assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
                assert "$.logprobs" in reply["message"] and reply["id"] == "bad"
        done = await whole(client, {**GREEDY, "max_tokens": 4, "logprobs": 20})
        check_entries(done["logprobs"], 20)
        assert len(done["logprobs"]) == 4


@daemon_test
async def test_a_grammar_request_reports_the_models_own_numbers() -> None:
    # Before the grammar's mask: a token it forced may be unlikely, but every number is
    # the model's, and the entries still cover the whole reply.
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**COPY, "format": "json", "logprobs": 2})
        json.loads(done["text"])
        entries = done["logprobs"]
        check_entries(entries, 2, greedy=False)
        assert len(entries) == done["usage"]["completion_tokens"]
        assert joined(entries) == done["text"].encode()
