"""The draft gate (engine/draftgate.py): step costs by rows, the expected tokens of a
draft, the length that pays most; the costs file (engine/costsfile.py); and, live, a
daemon whose drafts are judged by the step costs it measured.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_draftgate.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.config import SpeculativeConfig
from sfcore_daemon.engine import costsfile
from sfcore_daemon.engine.draftgate import (
    AcceptanceBook,
    StepCosts,
    best_length,
    expected_tokens,
    prior_acceptance,
    search_length,
)
from sfcore_daemon.engine.drafting import DraftPlan
from sfcore_daemon.engine.prefillshare import PrefillShare
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.engine.speculative import NgramDrafter, draft_settings
from sfcore_daemon.llama.stepcost import PROMPT_ROW_KEY


def costs_of(table: dict[int, float], most: int = 70) -> StepCosts:
    return StepCosts({rows: ms * 1e6 for rows, ms in table.items()}, most)


def rising_costs(increments: list[float]) -> StepCosts:
    """Costs that rise by `increments` (ms) from 1 ms at one row, with at least 2 sizes."""
    table, total = {}, 1.0
    for size, extra in enumerate(increments, start=1):
        total += extra
        table[size] = total
    table.setdefault(2, table[1] + 1.0)
    return costs_of(table)


def test_costs_need_a_one_row_step_and_one_more() -> None:
    with pytest.raises(ValueError):
        StepCosts({1: 10e6}, 16)
    with pytest.raises(ValueError):
        StepCosts({2: 10e6, 4: 20e6}, 16)


def test_unmeasured_sizes_are_drawn_between_and_past_the_measured() -> None:
    costs = costs_of({1: 10, 5: 30})
    assert costs.cost(1) == 10e6 and costs.cost(5) == 30e6
    assert costs.cost(3) == 20e6  # halfway
    assert costs.cost(7) == 40e6  # past them: the mean row of the range (5 ms)
    assert costs.cost(100) > costs.cost(70)  # past the table too
    assert costs.ratios()[5] == 3.0


def test_expected_tokens() -> None:
    assert expected_tokens(1.0, 5) == 5
    assert expected_tokens(0.0, 5) == 0
    assert math.isclose(expected_tokens(0.5, 2), 0.5 + 0.25)


@given(st.floats(0.0, 1.0), st.integers(1, 64))
def test_expected_tokens_is_within_the_draft(p: float, k: int) -> None:
    gain = expected_tokens(p, k)
    assert 0.0 <= gain <= k + 1e-9
    assert gain <= expected_tokens(p, k + 1) + 1e-9


def test_rows_that_cost_a_quarter_step_pay_for_a_likely_draft() -> None:
    # The default model: 13.3 ms a lone row, 3.7 ms each further (docs/performance.md).
    costs = costs_of({rows: 13.3 + 3.7 * (rows - 1) for rows in (1, 2, 4, 8, 16)})
    kept, gain = best_length(costs, 1, 1.0, 0.9, longest=16, shortest=2, multiple=1)
    assert kept >= 4 and gain > 2


def test_an_unlikely_draft_is_dropped() -> None:
    costs = costs_of({rows: 5.0 + 2.0 * (rows - 1) for rows in (1, 2, 3, 4, 8)})
    assert best_length(costs, 1, 1.0, 0.3, longest=8, shortest=2, multiple=1) == (0, 0.0)


def test_with_one_row_as_dear_as_a_step_nothing_pays() -> None:
    costs = costs_of({rows: 10.0 * rows for rows in range(1, 10)})
    assert best_length(costs, 1, 1.0, 0.99, longest=8, shortest=2, multiple=1)[0] == 0


@given(st.floats(0.0, 1.0), st.integers(2, 32), st.integers(1, 8),
       st.lists(st.floats(0.0, 100.0), min_size=1, max_size=16))
def test_the_length_chosen_is_none_or_pays(p: float, longest: int, rows: int,
                                           increments: list[float]) -> None:
    costs = rising_costs(increments)
    kept, gain = best_length(costs, rows, float(rows), p, longest=longest, shortest=2,
                             multiple=4)
    assert kept == 0 or 2 <= kept <= longest
    if kept:  # it pays, by the same estimates
        assert (rows + gain) / costs.cost(rows + kept) > rows / costs.cost(rows)
    else:
        assert gain == 0.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.floats(0.0, 100.0), min_size=1, max_size=16),
       st.integers(2, 320), st.integers(1, 8), st.floats(0.0, 1.0))
def test_below_the_least_paying_chance_no_length_pays(
        rows: int, increments: list[float], longest: int, multiple: int, below: float) -> None:
    # best_length's shortcut gives the answer of the full search.
    costs = rising_costs(increments)
    least = costs.least_paying(rows)
    assert costs.least_paying(rows) == least  # kept
    p = least * below
    assert search_length(costs, rows, float(rows), p, longest=longest, shortest=2,
                         multiple=multiple) == (0, 0.0)


def test_a_step_is_timed_as_a_one_row_step_for_the_thread_policy() -> None:
    # 8 rows cost 2.5 one-row steps: a 25 ms step of 8 rows runs at a one-row step's
    # 10 ms pace, so a drafted step is not mistaken for a stretched one.
    costs = costs_of({1: 10.0, 8: 25.0})
    assert costs.as_one_row(25_000_000, 8) == 10_000_000
    assert costs.as_one_row(7_000_000, 1) == 7_000_000
    assert costs.as_one_row(50_000_000, 8) == 20_000_000  # twice as slow: stretched


def test_the_least_paying_chance_is_the_bound_itself() -> None:
    # A row at a quarter of a step: drafts pay from a modest chance, and just above the
    # bound some length does.
    costs = costs_of({rows: 13.3 + 3.7 * (rows - 1) for rows in (1, 2, 4, 8, 16)})
    least = costs.least_paying(1)
    assert 0.2 < least < 0.6
    assert best_length(costs, 1, 1.0, least + 1e-4, longest=320, shortest=2,
                       multiple=1)[0] > 0
    # Every row as dear as a step: nothing pays at any chance.
    assert costs_of({rows: 10.0 * rows for rows in range(1, 10)}).least_paying(1) >= 0.999


def test_a_match_that_runs_back_further_is_trusted_more() -> None:
    assert prior_acceptance(4) == pytest.approx(0.625)
    chances = [prior_acceptance(run) for run in range(2, 33)]
    assert chances == sorted(chances) and chances[-1] > 0.9
    assert prior_acceptance(16, sampled=True) < prior_acceptance(16)
    # The same text copied after 4 and after 20 tokens of shared context.
    shared = list(range(100, 120))
    short = NgramDrafter(draft_settings(SpeculativeConfig()), [*shared, 7, 8, 9, 10, 11, 1,
                                                                7, 8, 9, 10])
    long = NgramDrafter(draft_settings(SpeculativeConfig()), [*shared, 11, 1, *shared])
    short.propose(8)
    long.propose(8)
    assert short.run == 4 and long.run == 20
    assert long.acceptance() > short.acceptance()
    # A long run drafts further (twice as far as it runs back).
    assert long.propose(64)[1] > short.propose(64)[1]


def test_the_book_learns_what_drafts_of_each_kind_are_worth() -> None:
    book = AcceptanceBook()
    assert book.chance(0, False, 16) == pytest.approx(prior_acceptance(16))
    for _ in range(30):  # long own matches in greedy text: accepted whole
        book.record(0, False, 16, 16, 16)
    for _ in range(30):  # short own matches in sampled text: rejected at once
        book.record(0, True, 5, 8, 0)
    assert book.chance(0, False, 20) > 0.97  # the same bucket (16-31)
    assert book.chance(0, True, 6) < 0.2
    # Other kinds keep the prior: another source, run or kind of request.
    assert book.chance(1, False, 16) == pytest.approx(prior_acceptance(16))
    assert book.chance(0, False, 5) == pytest.approx(prior_acceptance(5))
    assert book.chance(0, True, 16) == pytest.approx(prior_acceptance(16, sampled=True))


@given(st.lists(st.tuples(st.integers(0, 1), st.booleans(), st.integers(0, 300),
                          st.integers(1, 64), st.integers(0, 64)), max_size=60),
       st.integers(0, 1), st.booleans(), st.integers(0, 300))
def test_the_book_gives_a_chance_whatever_it_recorded(
        records: list[tuple[int, bool, int, int, int]], source: int, sampled: bool,
        run: int) -> None:
    book = AcceptanceBook()
    for kind, sample, length, drafted, accepted in records:
        book.record(kind, sample, length, drafted, min(accepted, drafted))
    assert 0.0 < book.chance(source, sampled, run) < 1.0


def test_a_drafter_with_the_book_judges_by_it_and_teaches_it() -> None:
    book = AcceptanceBook()
    for _ in range(40):
        book.record(0, False, 3, 4, 0)
    text = [1, 2, 3, 4, 1, 2, 3]
    with_book = NgramDrafter(draft_settings(SpeculativeConfig()), text, book=book)
    seeded = NgramDrafter(draft_settings(SpeculativeConfig()), text)
    with_book.propose(8)
    seeded.propose(8)
    assert with_book.acceptance() < 0.3 < seeded.acceptance()
    before = book.chance(0, False, 3)
    with_book.verified(4, 4)  # what it verified goes into the book
    assert book.chance(0, False, 3) > before


def test_the_book_may_lower_a_first_draft_s_chance_but_never_raise_it() -> None:
    # Bare 4-token matches in greedy text, accepted whole by earlier requests (as the
    # store's drafts of regenerated answers were): the book then rates them near 1.
    book = AcceptanceBook()
    for _ in range(40):
        book.record(0, False, 3, 8, 8)
    assert book.chance(0, False, 3) > 0.95
    text = [1, 2, 3, 4, 1, 2, 3]
    drafter = NgramDrafter(draft_settings(SpeculativeConfig()), text, book=book)
    drafter.propose(8)
    assert drafter.run == 3
    # Before the request's own first verified draft: no more than the run promises.
    assert drafter.acceptance() == pytest.approx(prior_acceptance(3))
    drafter.verified(4, 4)
    # After it, its own drafts and the book together, as before.
    assert drafter.acceptance() > 0.9


def test_a_sequence_that_keeps_failing_stops_drafting_by_the_gate() -> None:
    drafter = NgramDrafter(draft_settings(SpeculativeConfig()), [1, 2, 3, 4, 1, 2, 3])
    assert drafter.propose(8)[0][:1] == [4]
    assert drafter.run == 3  # [1, 2, 3] matched, nothing further back
    assert drafter.acceptance() == pytest.approx(prior_acceptance(3)) == pytest.approx(4 / 7)
    for _ in range(6):
        drafter.verified(8, 0)
    assert drafter.acceptance() < 0.3
    for _ in range(6):
        drafter.verified(8, 8)
    assert drafter.acceptance() > 0.8


def test_the_costs_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "step-costs" / "key.json"
    costsfile.save(path, {1: 5e6, 4: 9e6})
    assert costsfile.load(path) == {1: 5e6, 4: 9e6}
    assert costsfile.load(tmp_path / "missing.json") is None


@pytest.mark.parametrize("text", [
    b"", b"{", b"[]", b'{"version": 3}', b'{"version": 2, "ns": {"1": 5, "2": 9}}',
    b'{"version": 3, "ns": {"1": 5}}', b'{"version": 3, "ns": {"2": 5, "3": 9}}',
    b'{"version": 3, "ns": {"1": -5, "2": 9}}', b'{"version": 3, "ns": {"0": 5, "1": 9}}',
    b'{"version": 3, "ns": {"1": 0, "2": 9}}', b'{"version": 3, "ns": {"0": -1, "1": 5, "2": 9}}',
    b'{"version": 3, "ns": {"-5": 1, "1": 5, "2": 9}}',
    b'{"version": 3, "ns": {"-1": -2, "1": 5, "2": 9}}',
    b'{"version": 3, "ns": {"1": 5, "2": 9}, "more": 1}', b"\xff\xfe",
])
def test_a_file_that_is_not_costs_is_measured_again(text: bytes) -> None:
    assert costsfile.parse(text) is None


@given(st.binary(max_size=256) | st.from_type(dict).map(lambda value: json.dumps(
    value, default=str).encode()))
def test_any_bytes_read_as_costs_or_as_nothing(data: bytes) -> None:
    parsed = costsfile.parse(data)
    if parsed is not None:
        assert 1 in parsed and sum(rows > 0 for rows in parsed) >= 2
        assert all(ns > 0 if rows > 0 else rows >= -4 and ns >= 0 for rows, ns in parsed.items())
        StepCosts(parsed, 64)  # and the gate takes them
        try:
            PrefillShare(parsed, 64)  # and so do steps beside streams, given a prompt row's cost
        except ValueError:
            assert parsed.get(PROMPT_ROW_KEY, 0.0) <= 0.0


@given(st.dictionaries(st.integers(-4, 64), st.floats(1.0, 1e9), min_size=1, max_size=20))
def test_costs_survive_the_file(ns: dict[int, float]) -> None:
    ns = {1: 1e6, **ns}
    data = msgspec.json.encode({"version": 3, "ns": ns})
    parsed = costsfile.parse(data)
    assert parsed == (ns if sum(rows > 0 for rows in ns) >= 2 else None)


def _copying_seq(seq_id: int, book: AcceptanceBook | None = None) -> Seq:
    """A generating sequence in the middle of copying a 40-token text: its drafter
    proposes the rest of the copy, with a long run."""
    text = list(range(1000, 1040))
    seq = Seq(seq_id)
    seq.drafter = NgramDrafter(draft_settings(SpeculativeConfig()), [*text, 7, *text[:36]],
                               book=book)
    seq.job = SimpleNamespace(grammar=None, grammar_live=False)  # type: ignore[assignment]
    seq.forced = None
    seq.limit, seq.n_out, seq.generating = 500, 0, True
    return seq


def test_alone_a_step_drafts_as_far_as_pays_shared_at_most_twice_its_time() -> None:
    # SmolLM2's step costs here: a row of logits about 0.4 of a one-row step.
    costs = costs_of({1: 5.0, 2: 10.3, 3: 12.2, 4: 14.9, 5: 17.7, 8: 21.4, 9: 24.3,
                      16: 33.9, 17: 38.0})
    settings = draft_settings(SpeculativeConfig())
    alone = DraftPlan(settings, 64, [_copying_seq(0)], costs)
    assert alone.rows >= 7  # a long copy pays where it is the only request
    for others in (1, 3):
        stepping = [_copying_seq(i) for i in range(others + 1)]
        plan = DraftPlan(settings, 64, stepping, costs, shared=True)
        base = len(stepping)
        assert costs.cost(base + plan.rows) <= 2.0 * costs.cost(base) + 1e-9
    # One generating sequence beside another's prompt: shared too.
    shared = DraftPlan(settings, 64, [_copying_seq(0)], costs, shared=True)
    assert costs.cost(1 + shared.rows) <= 2.0 * costs.cost(1)
    # Four copies draft beside each other, but not in a step that ends another
    # request's prompt: its first token waits for all of the step.
    four = [_copying_seq(i) for i in range(4)]
    assert DraftPlan(settings, 64, four, costs, shared=True).rows > 0
    four = [_copying_seq(i) for i in range(4)]
    assert DraftPlan(settings, 64, four, costs, shared=True, first_token=True).rows == 0


def test_drafts_cost_more_at_depth() -> None:
    """Key 0 is what a row adds per cell of context: at depth a draft must be likelier
    to pay, and a cost measured without it (an older file) changes nothing."""
    costs = StepCosts({0: 100.0, 1: 1e6, 4: 1.3e6, 8: 1.8e6}, 16)
    shallow = costs.least_paying(1)
    assert costs.cost(4) == 1.3e6
    costs.depth = 4000
    assert costs.cost(4) == 1.3e6 + 4 * 4000 * 100.0
    assert costs.cost(1) == 1e6 + 4000 * 100.0
    assert costs.least_paying(1) > shallow
    # At depth a step at the measured pace reads as a one-row step with no context: the
    # thread policy's baseline does not take a long context for a loaded machine.
    assert costs.as_one_row(int(costs.cost(4)), 4) == pytest.approx(1e6, abs=1)
    assert costs.as_one_row(int(costs.cost(1)), 1) == pytest.approx(1e6, abs=1)
    assert costs.as_one_row(int(2 * costs.cost(1)), 1) == pytest.approx(2e6, abs=2)
    costs.depth = 0
    assert costs.least_paying(1) == shallow
    flat = StepCosts({1: 1e6, 4: 1.3e6, 8: 1.8e6}, 16)
    flat.depth = 4000
    assert flat.cost(4) == 1.3e6
