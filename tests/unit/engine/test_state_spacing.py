"""Which of a long prompt's cuts and its end get a state of their own (storepolicy)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.engine.storepolicy import _EXACT_SLACK, _spaced


def test_a_chat_prompt_keeps_one_state_at_its_last_turn_start() -> None:
    # A short last question: its turn start, the model's turn start three tokens
    # before the end, and the end. The two past the first add too little.
    assert _spaced([13_585, 13_595, 13_598]) == [13_585]


def test_ends_a_slack_apart_each_keep_their_state() -> None:
    assert _spaced([1_000, 1_000 + _EXACT_SLACK, 1_000 + 3 * _EXACT_SLACK]) == [
        1_000, 1_000 + _EXACT_SLACK, 1_000 + 3 * _EXACT_SLACK]


@given(st.lists(st.integers(min_value=1, max_value=100_000), min_size=1, max_size=8,
                unique=True).map(sorted))
def test_every_end_left_out_is_within_the_slack_past_one_taken(ends: list[int]) -> None:
    taken = _spaced(ends)
    assert taken[0] == ends[0] and set(taken) <= set(ends)
    assert all(later - earlier >= _EXACT_SLACK for earlier, later in itertools.pairwise(taken))
    for end in set(ends) - set(taken):
        assert any(0 < end - kept < _EXACT_SLACK for kept in taken)
