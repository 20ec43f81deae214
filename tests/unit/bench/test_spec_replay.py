"""The spec-replay bench's model of llama.cpp's ngram-simple drafter."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kit.benchkit import benchkit_module

spec_replay: Any = benchkit_module("benchkit.sections.spec_replay")
simple_draft = spec_replay.simple_draft
SIMPLE_MATCH: int = spec_replay.SIMPLE_MATCH
SIMPLE_MAX: int = spec_replay.SIMPLE_MAX


def test_a_repeated_passage_drafts_what_followed_its_latest_occurrence() -> None:
    passage = list(range(100, 100 + SIMPLE_MATCH))
    before = list(range(1000, 1070))
    first_after = list(range(2000, 2060))
    second_after = list(range(3000, 3060))
    tokens = before + passage + first_after + passage + second_after + passage[:-1]
    assert simple_draft(tokens, passage[-1]) == second_after[:SIMPLE_MAX]


def test_no_draft_where_fewer_than_the_match_length_follow() -> None:
    passage = list(range(100, 100 + SIMPLE_MATCH))
    # The passage's only earlier place is followed by its own first 11 tokens.
    tokens = list(range(1000, 1070)) + passage + passage[:-1]
    assert simple_draft(tokens, passage[-1]) == []


def test_short_texts_and_unseen_endings_draft_nothing() -> None:
    assert simple_draft(list(range(SIMPLE_MATCH + SIMPLE_MAX)), 7) == []
    assert simple_draft(list(range(500)), 10_000) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), max_size=200), st.integers(0, 1))
def test_a_draft_is_a_passage_that_followed_the_same_tokens(tokens: list[int],
                                                            sampled: int) -> None:
    draft = simple_draft(tokens, sampled)
    assert len(draft) == 0 or SIMPLE_MATCH <= len(draft) <= SIMPLE_MAX
    if draft:
        pattern = [*tokens[len(tokens) - SIMPLE_MATCH + 1:], sampled]
        places = [start for start in range(1, len(tokens) - SIMPLE_MATCH)
                  if tokens[start:start + SIMPLE_MATCH] == pattern
                  and tokens[start + SIMPLE_MATCH:start + SIMPLE_MATCH + len(draft)] == draft]
        assert places
