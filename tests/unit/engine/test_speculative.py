"""Speculative decoding: drafts from a sequence's own text, verified in the shared step.

The pure drafter is tested alone; everything else runs the real daemon on its socket.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_speculative.py.
"""

from __future__ import annotations

import tracemalloc
from random import Random

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

SETTINGS = DraftSettings(draft_max=16, draft_start=4, ngram_max=3, ngram_min=2)


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


def test_a_short_match_that_failed_does_not_lower_a_loops_acceptance() -> None:
    # Early in free text a 2-gram match drafts wrong; later the text loops and a match
    # runs back over the whole loop. The miss was a short run's: the loop's chance is
    # its prior's, not the miss's (one early miss kept a loop undrafted for a request).
    drafter = NgramDrafter(SETTINGS, [5, 6, 7, 8, 9, 5, 6])
    assert drafter.draft(16)[:2] == [7, 8]
    short = drafter.run
    drafter.verified(4, 0)
    failed_short = drafter.acceptance()
    loop = list(range(20, 40))
    for token in [1, *loop, *loop[:10]]:
        drafter.append(token)
    assert drafter.draft(16)[:4] == loop[10:14]
    assert drafter.run > short
    fresh = NgramDrafter(SETTINGS, [5, 6, 7, 8, 9, 5, 6, 1, *loop, *loop[:10]])
    fresh.draft(16)
    assert fresh.run == drafter.run
    assert drafter.acceptance() == fresh.acceptance() > failed_short


def test_a_copy_keeps_its_evidence_when_its_run_reaches_a_longer_bucket() -> None:
    # A copy's drafts were accepted whole while its match ran back 8-15 tokens; once the
    # run passes 16 its chance starts from that evidence, not from the fixed prior again
    # (each doubling of the run cut the next draft short on the default model's edits).
    settings = DraftSettings(draft_max=64, draft_start=4, ngram_max=3, ngram_min=2)
    source = list(range(100, 160))
    drafter = NgramDrafter(settings, [*source, 1, *source[:12]])
    assert drafter.draft(8) == source[12:20] and 8 <= drafter.run < 16
    prior = drafter.acceptance()
    drafter.verified(8, 8)
    copied = drafter.acceptance()
    assert copied > prior
    for token in source[12:21]:
        drafter.append(token)
    assert drafter.draft(8) == source[21:29] and drafter.run >= 16
    fresh = NgramDrafter(settings, [*source, 1, *source[:21]])
    fresh.draft(8)
    assert fresh.run == drafter.run
    assert drafter.acceptance() >= copied > fresh.acceptance()
    # A miss at the shorter run never lowers the longer run's first chance.
    failed = NgramDrafter(settings, [*source, 1, *source[:12]])
    failed.draft(8)
    failed.verified(8, 0)
    for token in source[12:21]:
        failed.append(token)
    failed.draft(8)
    assert failed.acceptance() == fresh.acceptance()
