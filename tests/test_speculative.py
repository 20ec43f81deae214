"""Speculative decoding: drafts from a sequence's own text, verified in the shared step.

The pure drafter is tested alone; everything else runs the real daemon on its socket.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from random import Random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.config import SpeculativeConfig
from sfcore_daemon.engine.speculative import (
    DraftSettings,
    NgramDrafter,
    NgramStore,
    aligned_lengths,
    draft_settings,
)
from tests.fault_support import health, poll_until
from tests.harness import Daemon, done_of, merge, running_daemon, tokens_text

SETTINGS = DraftSettings(draft_max=16, draft_start=4, ngram_max=3, ngram_min=2)

MODULE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def total_price(items):
    return sum(item.price * item.quantity for item in items)


def cheapest(items):
    return min(items, key=lambda item: item.price)
'''
RECORD = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
# Prompts whose answers copy from the prompt (drafts are accepted) and one that does not.
COPY_CODE = {"op": "chat", "messages": [
    {"role": "user", "content": f"Copy this code exactly:\n```python\n{MODULE}```"}]}
COPY_JSON = {"op": "chat", "messages": [
    {"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}]}
FREE = {"prompt": "The history of the city of"}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                   "fields": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "born", "fields"],
}


# --- the drafter alone ----------------------------------------------------------------


def test_a_repeated_ngram_drafts_what_followed_it_last_time() -> None:
    drafter = NgramDrafter(SETTINGS, [1, 2, 3, 4, 5, 6, 9, 1, 2])
    assert drafter.draft(16) == [3, 4, 5, 6]  # draft_start tokens
    drafter.append(7)  # "1 2 7": the latest occurrence of "2 7"... none; "7" alone is too short
    assert drafter.draft(16) == []


def test_the_latest_occurrence_wins_and_room_clips_the_draft() -> None:
    drafter = NgramDrafter(SETTINGS, [5, 6, 1, 1, 5, 6, 2, 2, 8, 5, 6])
    assert drafter.draft(16) == [2, 2, 8, 5]
    assert drafter.draft(3) == [2, 2, 8]
    assert drafter.draft(1) == []  # a one-token draft never pays


def test_a_match_at_the_end_repeats_its_period() -> None:
    drafter = NgramDrafter(SETTINGS, [7, 8, 9, 7, 8, 9, 7, 8])
    # "7 8 9 7 8" recurs 5 tokens back: a loop in progress, drafted 10 tokens ahead.
    assert drafter.draft(16) == [9, 7, 8, 9, 7, 8, 9, 7, 8, 9]


def test_a_match_drafts_twice_as_far_as_it_runs_back_and_failure_pauses_it() -> None:
    tokens = [*range(100, 140), *range(100, 103)]
    drafter = NgramDrafter(SETTINGS, tokens)
    assert drafter.draft(64) == list(range(103, 109))  # "100 101 102": 3 back, 6 ahead
    drafter.verified(6, 6)
    for token in range(103, 109):
        drafter.append(token)
    assert drafter.draft(64) == list(range(109, 125))  # 9 back: draft_max (16)
    drafter.verified(16, 1)  # accepted in part: at most 4 x (1 + 1) next
    drafter.append(109)
    drafter.append(110)
    assert drafter.draft(64) == list(range(111, 119))
    drafter.verified(8, 0)
    assert drafter.draft(64) == []  # paused after a draft that verified nothing
    for token in (1, 2, 3, 4):
        drafter.append(token)
    drafter.append(100)
    drafter.append(101)
    # The pause is over: "100 101" last continued with 102, matched 2 back: draft_start.
    assert drafter.draft(64) == [102, 103, 104, 105]
    assert (drafter.drafted, drafter.accepted) == (30, 7)


def test_a_proposal_carries_the_continuation_beyond_the_draft() -> None:
    drafter = NgramDrafter(SETTINGS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    continuation, length = drafter.propose(7)
    assert (continuation, length) == ([3, 4, 5, 6, 7, 8, 9], 4)  # draft_start of room 7
    assert drafter.draft(7) == continuation[:length]
    looping = NgramDrafter(SETTINGS, [7, 8, 9, 7, 8])
    assert looping.propose(8) == ([9, 7, 8, 9, 7, 8, 9, 7], 4)  # the period repeats to room
    assert NgramDrafter(SETTINGS, [1, 2, 3]).propose(8) == ([], 0)


def test_drafts_are_rounded_to_whole_multiples_of_logit_rows() -> None:
    # One sequence (1 pending row): 1 + 4 = 5 rows, one past 4: the draft's last token
    # goes; 1 + 5 = 6: grown by 2 to 8 rows; 1 + 2 = 3, below 4: grown to 4.
    assert aligned_lengths(1, [4], [20], 4, 60) == [3]
    assert aligned_lengths(1, [5], [20], 4, 59) == [7]
    assert aligned_lengths(1, [2], [20], 4, 62) == [3]
    assert aligned_lengths(1, [7], [20], 4, 57) == [7]  # already whole
    # Growth stops at a draft's continuation or the step's spare rows; then it is cut.
    assert aligned_lengths(1, [5], [6], 4, 59) == [3]
    assert aligned_lengths(1, [5], [20], 4, 1) == [3]
    assert aligned_lengths(1, [2], [2], 4, 62) == [2]  # below 4 and cannot grow: as is
    # Several sequences: 3 pending rows + 2 + 4 = 9 -> the longest draft loses its last;
    # 3 + 4 + 3 = 10 -> the longest grows by 2 (its continuation allows), else the next.
    assert aligned_lengths(3, [2, 4, 0], [8, 8, 0], 4, 58) == [2, 3, 0]
    assert aligned_lengths(3, [4, 3, 0], [30, 30, 0], 4, 57) == [6, 3, 0]
    assert aligned_lengths(3, [4, 3, 0], [5, 30, 0], 4, 57) == [5, 4, 0]
    # A multiple of 1 changes nothing; nor does a step without drafts.
    assert aligned_lengths(1, [5], [20], 1, 59) == [5]
    assert aligned_lengths(5, [0, 0], [0, 0], 4, 64) == [0, 0]


def test_a_later_request_drafts_what_an_earlier_one_generated() -> None:
    store = NgramStore(3, 1000)
    earlier = NgramDrafter(SETTINGS, [1, 2, 3], store)
    for token in (40, 41, 42, 43, 44, 45):
        earlier.append(token)
    earlier.learn()
    # Its own text has no match; the store has: "2 3 40" was followed by 41 ... (as far
    # as an own match of the same run would draft: twice the 3 tokens, to the text's end).
    later = NgramDrafter(SETTINGS, [9, 2, 3, 40], store)
    assert later.draft(16) == [41, 42, 43, 44, 45]
    assert later.source == 1 and later.run == 3
    # Never across the end of the learned text.
    tail = NgramDrafter(SETTINGS, [7, 43, 44, 45], store)
    assert tail.draft(16) == []
    # The prompt itself is not learned (a later request's own text has it).
    prompt_only = NgramDrafter(SETTINGS, [5, 1, 2], store)
    assert prompt_only.draft(16) == []


class _ReferenceStore:
    """What NgramStore answers, without its memory bound: the latest occurrence of
    every n-gram in a dict (the store's first form), emptied whole as the store is."""

    def __init__(self, n: int, capacity: int) -> None:
        self.n, self.capacity = n, capacity
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], int] = {}

    def add(self, tokens: list[int], start: int) -> None:
        n = self.n
        first = max(start - n, 0)
        if not n < len(tokens) - first < self.capacity:
            return
        if len(self.tokens) + len(tokens) - first > self.capacity:
            self.tokens, self.positions = [], {}
        base = len(self.tokens)
        self.tokens += [*tokens[first:], -1]
        for i in range(len(tokens) - first - n):
            self.positions[tuple(tokens[first + i:first + i + n])] = base + n + i

    def draft(self, tokens: list[int], want: int) -> list[int]:
        start = self.positions.get(tuple(tokens[-self.n:]))
        if start is None or len(tokens) < self.n:
            return []
        draft = self.tokens[start:start + want]
        return draft[:draft.index(-1)] if -1 in draft else draft


_TEXTS = st.lists(st.integers(0, 6), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 4), capacity=st.integers(1, 120),
       texts=st.lists(st.tuples(_TEXTS, st.integers(0, 12)), max_size=12),
       queries=st.lists(_TEXTS, max_size=12))
def test_the_store_drafts_what_the_latest_occurrence_continues_with_or_nothing(
        n: int, capacity: int, texts: list[tuple[list[int], int]],
        queries: list[list[int]]) -> None:
    # A small alphabet: n-grams repeat, and small tables collide. A draft is the
    # reference's (never a wrong one); a collision may only make it empty.
    store, reference = NgramStore(n, capacity), _ReferenceStore(n, capacity)
    for tokens, start in texts:
        store.add(tokens, start)
        reference.add(tokens, start)
    for query in queries + [tokens for tokens, _ in texts]:
        drafted, _, _ = store.match(query, 8, n)
        assert drafted in ([], reference.draft(query, 8)), (query, drafted)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 4), texts=st.lists(st.tuples(_TEXTS, st.integers(0, 12)), max_size=8),
       queries=st.lists(st.tuples(_TEXTS, st.integers(-5, 400)), max_size=12))
def test_a_hinted_match_is_a_stored_occurrence_of_the_text_s_end_or_nothing(
        n: int, texts: list[tuple[list[int], int]], queries: list[tuple[list[int], int]]) -> None:
    # Any hint, stale or out of range: the draft follows a place whose n tokens before
    # it end the text, runs back as far as it says, and never crosses a stored text's end.
    store = NgramStore(n, 200)
    for tokens, start in texts:
        store.add(tokens, start)
    stored = store._tokens.tolist()
    for query, hint in queries:
        drafted, run, position = store.match(query, 8, 16, hint)
        if not run:
            assert (drafted, position) == ([], 0)
            continue
        assert n <= run <= min(16, len(query))
        assert stored[position - run:position] == query[-run:]
        assert drafted == stored[position:position + len(drafted)]
        assert -1 not in drafted and len(drafted) <= 8
        assert len(drafted) == 8 or stored[position + len(drafted)] == -1


def test_a_store_match_says_how_far_it_runs_back() -> None:
    store = NgramStore(4, 1000)
    answer = list(range(50, 90))
    store.add([1, 2, 3, 4, *answer], 4)
    # Regenerating the same answer: the stored text runs back as far as was asked.
    draft, run, _ = store.match([9, 1, 2, 3, 4, *answer[:20]], 8, 32)
    assert draft == answer[20:28] and run == 24
    # Only the last 4 tokens shared: a bare n-gram match.
    draft, run, _ = store.match([7, 7, 7, *answer[16:20]], 8, 32)
    assert draft == answer[20:28] and run == 4
    assert store.match([*answer[:20]], 8, 10)[1] == 10  # at most most_run


def test_a_regenerate_drafts_its_first_answer_over_the_prompt_it_copies() -> None:
    # The prompt holds a text; the first answer changed it after 6 tokens. Sent again,
    # the answer's own 4-gram matches the prompt (a short run) and the store (a run as
    # long as the answer so far): the store's draft follows the first answer.
    text = list(range(200, 230))
    prompt = [1, 2, *text, 3]
    answer = [*text[:6], 999, *text[7:]]
    store = NgramStore(4, 1000)
    store.add([*prompt, *answer], len(prompt))
    drafter = NgramDrafter(draft_settings(SpeculativeConfig(store_tokens=1000)),
                           [*prompt, *answer[:10]], store)
    draft = drafter.draft(8)
    assert drafter.source == 1 and draft == answer[10:18]
    # Far into a regenerate, the store's run is followed further back than an own
    # match's 32 tokens, so its drafts are trusted more.
    long_answer = list(range(300, 420))
    store.add([*prompt, *long_answer], len(prompt))
    regenerating = NgramDrafter(draft_settings(SpeculativeConfig(store_tokens=1000)),
                                [*prompt, *long_answer[:90]], store)
    assert regenerating.draft(8) == long_answer[90:98]
    assert regenerating.source == 1 and regenerating.run == 94  # the answer and 4 before
    assert regenerating.acceptance() > 0.95


def test_a_regenerate_follows_its_first_answer_where_its_lines_repeat() -> None:
    # The first answer repeats a line (code does): the table's latest occurrence of the
    # line's 4-grams is its second copy, which a regenerate standing in the first does
    # not continue from. The drafter follows the place its text stands in the store.
    line = [70, 71, 72, 73, 74]
    answer = [*range(100, 110), *line, *range(110, 120), *line, *range(120, 140)]
    prompt = [1, 2, 3, 4, 5]
    store = NgramStore(4, 1000)
    store.add([*prompt, *answer], len(prompt))
    settings = draft_settings(SpeculativeConfig(store_tokens=1000))
    # Without a place followed, the latest occurrence: the second copy's continuation.
    fresh = NgramDrafter(settings, [*prompt, *answer[:15]], store)
    assert fresh.draft(8) == answer[30:38]
    # A regenerate that drafted from the store at its start follows the first copy.
    regenerating = NgramDrafter(settings, [*prompt, *answer[:2]], store)
    assert regenerating.draft(8) == answer[2:10]
    for token in answer[2:15]:
        regenerating.append(token)
    draft = regenerating.draft(8)
    assert draft == answer[15:23] and regenerating.source == 1
    assert regenerating.run == 4 + 15  # the whole answer so far and the 4 before it
    # Once emptied, the store forgets the place (positions are reused).
    store.clear()
    store.add([9, 9, 9, 9, *answer[:15], 5, 6, 7, 8, 9, 10], 4)
    assert regenerating.draft(8) == [5, 6, 7, 8, 9, 10]


def test_the_store_takes_the_memory_it_says_and_no_more() -> None:
    # store_tokens is a bound in bytes too: 12 to 20 bytes a token (the token and its
    # slots), allocated at once; its first form took ~150 (a dict of n-gram tuples).
    for capacity in (1, 1000, 4096, 5000, 1 << 16):
        assert 12 * capacity <= NgramStore(4, capacity).nbytes <= 20 * capacity + 8
    random = Random(7)
    texts = [[random.randrange(262_144) for _ in range(400)] for _ in range(200)]
    tracemalloc.start()
    try:
        store = NgramStore(4, 1 << 16)
        for text in texts:  # 80,000 tokens: filled, emptied once, filled again
            store.add(text, 50)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used <= store.nbytes + 64 * 1024, (used, store.nbytes)
    assert store.match(texts[-1][:60], 4, store.n)[0] == texts[-1][60:64]


# --- the daemon -----------------------------------------------------------------------

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
    # only speculation differs between the runs (see ONE_SLOT). Drafts of at most 2
    # tokens: up to 3 rows a step llama.cpp computes each row bit for bit as a lone
    # row, so any difference is a wrong acceptance or a wrong cell, not numerics.
    # (From 4 rows on its matrix kernels round otherwise, and a near-tie such as
    # "dataclasses" in COPY_CODE can go the other way: docs/performance.md, Numerics.)
    exact = merge(ONE_SLOT, {"speculative": {"draft_max": 2, "draft_start": 2}})
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
    async with running_daemon({"model": {"reproducible": True}}) as daemon:
        async with daemon.client() as client:
            info = await client.final({"op": "info"})
        assert info["config"]["speculative"]["mode"] == "off"
        done = await generate(daemon, COPY_JSON, max_tokens=32)
        assert done["usage"]["drafted_tokens"] == 0


@pytest_asyncio_mark
async def test_speculation_off_in_the_config_never_drafts() -> None:
    # With no draft rows the context's output rows are the slots' and the prompt store's
    # spare sequence ids: llama.cpp asserts at start-up if there are fewer.
    async with running_daemon({"speculative": {"mode": "off"}}) as daemon:
        done = await generate(daemon, COPY_CODE, max_tokens=24)
        assert done["usage"]["completion_tokens"] == 24
        assert done["usage"]["drafted_tokens"] == 0
        assert (await stats(daemon))["speculative"]["drafted"] == 0
