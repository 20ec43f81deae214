"""Which idle slots leave the KV pool before a long prompt (Scheduler._stored_aside).

The real `Scheduler` over a fake engine and a fake prompt store: which slots a job's
placement evicts. The end-to-end check, with the model and the real store, is
tests/e2e/ndjson/test_prompt_store.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from sfcore_daemon.core.generation import Generation
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.engine.crossing import JobEnd, JobSpec, Placement
from sfcore_daemon.llama.sampling import Sampling
from sfcore_daemon.store.index import PromptIndex

pytestmark = pytest.mark.asyncio

MIN_TOKENS = 256
N_UBATCH = 512


@dataclass
class _Store:
    """The stored texts, as the scheduler asks of them."""

    stored: list[list[int]]
    min_tokens: int = MIN_TOKENS

    def stored_prefix(self, tokens: list[int]) -> int:
        return max((len(text) for text in self.stored if tokens[:len(text)] == text), default=0)

    stored_already = PromptIndex.stored_already  # the real rule, over these texts


@dataclass
class _Engine:
    store: _Store | None
    n_ctx: int = 1 << 20
    n_ubatch: int = N_UBATCH
    placements: list[Placement] = field(default_factory=list)

    def submit(self, _job: JobSpec, placement: Placement, *_args: Any) -> None:
        self.placements.append(placement)


class _Sink:
    def token(self, *_args: Any) -> None: ...

    def flush(self) -> None: ...

    def queued(self, *_args: Any) -> None: ...

    def done(self, *_args: Any) -> None: ...

    def error(self, *_args: Any) -> None: ...

    def close(self) -> None: ...


def _text(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


async def _evicted(store: _Store | None, idle: list[int], prompt: list[int],
                   cache_prompt: bool = True, idle_cache_prompt: bool = True
                   ) -> tuple[int, ...]:
    """Slot 0 left holding `idle` (by a request of `idle_cache_prompt`); what the next
    job, on another slot, evicts."""
    engine = _Engine(store)
    scheduler = Scheduler(engine, max_queue=8, slots=2)  # type: ignore[arg-type]
    stats = Stats()

    def submit(tokens: list[int], reuse: bool = True) -> Generation:
        generation = Generation(
            request_id="r", stream=False, stops=(), prompt=tokens, max_tokens=8,
            sampling=Sampling(temperature=0.0, top_k=40, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0, seed=None),
            cache_prompt=reuse, sink=_Sink(), arrived_ns=0,  # type: ignore[arg-type]
            loop=asyncio.get_running_loop(), stats=stats, priority="interactive")
        scheduler.submit(generation)
        return generation

    first = submit(idle[:1], idle_cache_prompt)
    first.end = JobEnd(end_reason="length", kept=idle)
    scheduler.release(first)
    submit(prompt, cache_prompt)
    (_, placement) = engine.placements
    assert placement.slot == 1
    return placement.evict


LONG_IDLE = _text(1000, 2000)
ANSWER = _text(9000, 24)


async def test_a_stored_idle_slot_leaves_before_a_prompt_longer_than_a_batch() -> None:
    store = _Store([LONG_IDLE])
    assert await _evicted(store, LONG_IDLE + ANSWER, _text(5000, N_UBATCH + 1)) == (0,)
    # cache_prompt false: the whole prompt is read, however much a slot shares.
    assert await _evicted(store, LONG_IDLE + ANSWER, _text(5000, N_UBATCH + 1), False) == (0,)


async def test_idle_slots_stay_before_a_prompt_of_one_batch() -> None:
    store = _Store([LONG_IDLE])
    assert await _evicted(store, LONG_IDLE + ANSWER, _text(5000, N_UBATCH)) == ()


async def test_a_slot_the_store_does_not_hold_leaves_too() -> None:
    # Its state is taken on the way out (StepLoop._begin): a long answer past the stored
    # prompt, or nothing of it stored at all.
    long_answer = _text(9000, MIN_TOKENS)
    assert await _evicted(_Store([LONG_IDLE]), LONG_IDLE + long_answer,
                          _text(5000, N_UBATCH + 1)) == (0,)
    assert await _evicted(_Store([]), LONG_IDLE + ANSWER, _text(5000, 4 * N_UBATCH)) == (0,)


async def test_short_slots_and_a_store_turned_off_keep_their_cells() -> None:
    short = _text(1000, MIN_TOKENS - 1)
    assert await _evicted(_Store([short]), short, _text(5000, 4 * N_UBATCH)) == ()
    assert await _evicted(None, LONG_IDLE + ANSWER, _text(5000, 4 * N_UBATCH)) == ()


async def test_a_slot_a_cache_prompt_false_request_left_leaves_store_or_not() -> None:
    # No state of it was kept, and it was not asked to be reused: nothing is lost.
    for store in (_Store([]), None):
        assert await _evicted(store, LONG_IDLE + ANSWER, _text(5000, N_UBATCH + 1),
                              idle_cache_prompt=False) == (0,)
        assert await _evicted(store, LONG_IDLE + ANSWER, _text(5000, N_UBATCH),
                              idle_cache_prompt=False) == ()
