"""How a step's rows are planned (StepBatch.fill): prompts beside streams, short rests
before long ones, and a short interactive rest read in a step of its own rather than
beside a long prompt's rows, which at depth cost the step more than the short rest does.
The batch is llama.cpp's own (llama_batch_init); the sequences are real `Seq`s with
stand-in jobs: only their prompt, priority and times are read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.engine.prefillshare import PrefillShare
from sfcore_daemon.engine.sequence import Seq
from sfcore_daemon.engine.stepbatch import _SHORT_REST, StepBatch
from sfcore_daemon.llama.stepcost import PROMPT_ROW_KEY

N_BATCH = 512
PREFILL_PER_STEP = 64


@contextmanager
def step_batch(slots: int = 4) -> Iterator[StepBatch]:
    steps = StepBatch(SimpleNamespace(n_batch=N_BATCH), slots,  # type: ignore[arg-type]
                      PREFILL_PER_STEP, None)
    try:
        yield steps
    finally:
        steps.free()


def reading(seq_id: int, prompt_tokens: int, read: int = 0, *, priority: str = "interactive",
            started: int = 0) -> Seq:
    """A sequence with `read` of its `prompt_tokens` prompt tokens in the cache."""
    seq = Seq(seq_id)
    spec = SimpleNamespace(prompt=list(range(prompt_tokens)), priority=priority)
    seq.job = SimpleNamespace(spec=spec, t_start=started, t_first=0)  # type: ignore[assignment]
    seq.next_prompt = read
    seq.cached = list(range(read))
    return seq


def streaming(seq_id: int, context: int, *, started: int = 0, first: int = 1) -> Seq:
    """A sequence past its prompt, one pending token a step."""
    seq = reading(seq_id, context, context, started=started)
    assert seq.job is not None
    seq.job.t_first = first
    seq.generating = True
    return seq


def rows_of(steps: StepBatch, n: int) -> dict[int, int]:
    """Rows a sequence has in the step just planned, by sequence id."""
    counts: dict[int, int] = {}
    for row in range(n):
        seq_id = steps.batch.seq_id[row][0]
        counts[seq_id] = counts.get(seq_id, 0) + 1
    return counts


def test_a_long_prompt_alone_is_read_in_whole_n_batch_chunks() -> None:
    long = reading(0, 5000, 1024)
    with step_batch() as steps:
        n = steps.fill([long])
        assert n == N_BATCH
        assert steps.prefilling == [long]
        assert long.chunk_end == 1024 + N_BATCH


def test_a_short_request_beside_a_long_prompt_gets_a_step_without_the_long_rows() -> None:
    long = reading(0, 13000, 3072)
    short = reading(1, 12, started=5)
    with step_batch() as steps:
        n = steps.fill([long, short])
        assert rows_of(steps, n) == {1: 12}
        assert steps.prefilling == [short]
        assert steps.outputs == [(short, 11)]
        # Once the short request streams, the long prompt reads on beside it, a bounded
        # number of rows a step.
        short.next_prompt, short.cached = 12, list(range(12))
        short.generating = True
        assert short.job is not None
        short.job.t_first = 6
        n = steps.fill([long, short])
        assert rows_of(steps, n) == {1: 1, 0: PREFILL_PER_STEP}


def test_short_rests_share_a_step_with_each_other_but_not_with_a_long_prompt() -> None:
    long = reading(0, 9000, 2048)
    shorts = [reading(seq_id, tokens, started=seq_id) for seq_id, tokens in ((1, 9), (2, 7))]
    with step_batch() as steps:
        n = steps.fill([long, *shorts])
        assert rows_of(steps, n) == {2: 7, 1: 9}  # the shortest first


def test_short_rests_a_step_follow_the_measured_costs() -> None:
    # Eight 20-token rests. A step's fixed part of 10 ms and 1 ms a prompt row give
    # sqrt(10 * 160) = 40 rows: two rests a step. At 10 ms a row, one a step.
    shorts = [reading(seq_id, 20, started=seq_id) for seq_id in range(8)]
    for row_ms, rests in ((1.0, 2), (10.0, 1), (0.1, 6)):
        with step_batch(slots=8) as steps:
            steps.share = PrefillShare({1: 10e6, 2: 12e6, PROMPT_ROW_KEY: row_ms * 1e6}, 8)
            n = steps.fill(shorts)
            assert len(steps.prefilling) == rests and n == 20 * rests, (row_ms, n)


def test_a_background_short_rest_leaves_the_long_prompt_its_rows() -> None:
    long = reading(0, 9000, 2048)
    short = reading(1, 10, priority="background", started=1)
    with step_batch() as steps:
        n = steps.fill([long, short])
        counts = rows_of(steps, n)
        assert counts[1] == 10
        assert counts[0] > 0


def test_streams_keep_their_rows_in_a_short_request_s_step() -> None:
    long = reading(0, 9000, 2048)
    streams = [streaming(seq_id, 300) for seq_id in (1, 2)]
    short = reading(3, 20, started=5)
    with step_batch() as steps:
        n = steps.fill([long, *streams, short])
        assert rows_of(steps, n) == {1: 1, 2: 1, 3: 20}


@st.composite
def active_sequences(draw: Any) -> list[Seq]:
    count = draw(st.integers(1, 6))
    active: list[Seq] = []
    for seq_id in range(count):
        if draw(st.booleans()):
            active.append(streaming(seq_id, draw(st.integers(1, 4000)),
                                    started=draw(st.integers(0, 9)),
                                    first=draw(st.integers(0, 12))))
        else:
            tokens = draw(st.integers(2, 6000))
            active.append(reading(seq_id, tokens, draw(st.integers(0, tokens - 1)),
                                  priority=draw(st.sampled_from(["interactive", "background"])),
                                  started=draw(st.integers(0, 9))))
    return active


@settings(max_examples=200, deadline=None)
@given(active_sequences())
def test_every_plan_fits_the_batch_and_a_short_interactive_rest_reads_without_long_rows(
        active: list[Seq]) -> None:
    with step_batch(slots=len(active)) as steps:
        n = steps.fill(active)
        assert 0 < n <= N_BATCH
        counts = rows_of(steps, n)
        assert sum(counts.values()) == n
        for seq in steps.stepping:
            assert counts[seq.id] == 1
        for seq in steps.prefilling:
            assert seq.job is not None
            rest = len(seq.job.spec.prompt) - seq.next_prompt
            assert seq.next_prompt < seq.chunk_end <= len(seq.job.spec.prompt)
            assert counts[seq.id] == seq.chunk_end - seq.next_prompt
            if rest <= _SHORT_REST and steps.prefilling[0] is seq:
                # Read whole, but for a chunk's end: chunks end at n_batch multiples.
                assert seq.chunk_end == len(seq.job.spec.prompt) or seq.chunk_end % N_BATCH == 0
        rests = [len(seq.job.spec.prompt) - seq.next_prompt  # type: ignore[union-attr]
                 for seq in steps.prefilling]
        if rests and rests[0] <= _SHORT_REST and \
                steps.prefilling[0].job.spec.priority == "interactive":  # type: ignore[union-attr]
            assert all(rest <= _SHORT_REST for rest in rests), rests
