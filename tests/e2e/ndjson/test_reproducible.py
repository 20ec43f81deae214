"""The same request, the same bytes: greedy with speculation on and off, a seed beside
other streams, before and after other traffic, streamed or not.

`[model] reproducible = true` runs llama.cpp's row-invariant kernels (the project's
patches, sfcore_daemon/llama/invariant.py): a row's logits do not depend on the other
rows of its step (a draft, other slots' tokens, a prompt chunk), on the thread count, or
on where other sequences' cells sit in the pool. The daemon still batches every
request, drafts and reuses cached prompts; these tests hold it to the bytes of a lone
request decoded one token a step, and check that `done` says how to get them again.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kit import REPLY_TIMEOUT_S, Client, Daemon, done_of, running_daemon
from tests.kit.daemon import BackgroundDaemon
from tests.kit.models import smollm2_path
from tests.kit.prompts import MODULE, PREFIX, QUESTION_1

WAIT_S = REPLY_TIMEOUT_S * 10  # a hang bound: a loaded 2-core machine is slow
REPRODUCIBLE: dict[str, Any] = {"model": {"reproducible": True},
                                "server": {"slots": 8}, "generation": {"max_tokens": 256}}
STORY = "Once upon a time, in a small village by the sea, there lived a girl named Mia who"
GREEDY: dict[str, Any] = {"prompt": STORY, "temperature": 0.0, "max_tokens": 64}
# Past 512 cells of context, where a lone row's attention used to be split by thread.
LONG_GREEDY: dict[str, Any] = {"prompt": PREFIX + QUESTION_1, "temperature": 0.0,
                               "max_tokens": 40}
SEEDED: dict[str, Any] = {"prompt": STORY, "temperature": 0.9, "seed": 1234,
                          "max_tokens": 96}
EDIT: dict[str, Any] = {"op": "chat", "temperature": 0.0, "max_tokens": 160, "messages": [
    {"role": "user", "content": "Rename the function total_price to order_total in this "
                                f"module and give back the whole module:\n```python\n"
                                f"{MODULE}```"}]}
OTHERS = ["A short guide to growing tomatoes:", "The main causes of the French Revolution were",
          "Here is a recipe for bread:", "Dear diary, today I", "The rules of chess are",
          "List of the planets and their moons:", "The best way to learn a language is"]


async def final(client: Client, request: dict[str, Any]) -> dict[str, Any]:
    done = done_of(await client.request({"stream": False, **request}, timeout=WAIT_S))
    assert done["finish_reason"] in ("length", "stop"), done
    return done


async def streamed(client: Client, request: dict[str, Any]) -> str:
    lines = await client.request({**request, "stream": True}, timeout=WAIT_S)
    assert lines[-1]["type"] == "done", lines[-1]
    return "".join(line["text"] for line in lines if line["type"] == "token") + str(
        lines[-1]["text"])


async def beside(daemon: Daemon, client: Client, request: dict[str, Any],
                 streams: int) -> dict[str, Any]:
    """`request`'s reply while `streams` other clients stream, each started first."""
    others = [await daemon.connect() for _ in range(streams)]
    try:
        for index, other in enumerate(others):
            await other.start_streaming({
                "prompt": OTHERS[index % len(OTHERS)], "max_tokens": 80 + 9 * index,
                "temperature": 0.8, "seed": index, "stream": True})
        done = await final(client, request)
        for other in others:
            lines = await other.reply(timeout=WAIT_S)
            assert lines[-1]["type"] == "done", lines[-1]
        return done
    finally:
        for other in others:
            await other.close()


@pytest.mark.asyncio
@pytest.mark.timeout(1800)
async def test_greedy_is_the_same_with_speculation_streamed_and_after_traffic() -> None:
    async with running_daemon(REPRODUCIBLE) as daemon, daemon.client() as client:
        for request in (GREEDY, LONG_GREEDY):
            plain = await final(client, {**request, "speculative": False,
                                         "cache_prompt": False})
            text = plain["text"]
            assert text and plain["usage"]["drafted_tokens"] == 0
            # Speculation on, the prompt's cells reused, streamed and not.
            assert await streamed(client, request) == text
            assert (await final(client, request))["text"] == text
            # Beside three streams, then after them (their cells stay in the pool).
            assert (await beside(daemon, client, request, 3))["text"] == text
            assert (await final(client, request))["text"] == text
            assert (await final(client, {**request, "speculative": False}))["text"] == text
        # What reproduces it: the fingerprint is the same for every reply of this daemon.
        done = await final(client, GREEDY)
        assert done["model_fingerprint"].startswith("sha256:"), done
        assert done["sampler"]["temperature"] == 0.0 and "seed" not in done, done
        info = await client.final({"op": "info"})
        assert info["config"]["reproducible"] is True


@pytest.mark.asyncio
@pytest.mark.timeout(1800)
async def test_a_seed_repeats_alone_and_beside_three_and_seven_streams() -> None:
    async with running_daemon(REPRODUCIBLE) as daemon, daemon.client() as client:
        alone = await final(client, SEEDED)
        assert alone["seed"] == 1234 and alone["sampler"]["temperature"] == 0.9, alone
        text = alone["text"]
        assert (await beside(daemon, client, SEEDED, 3))["text"] == text
        assert (await beside(daemon, client, {**SEEDED, "cache_prompt": False}, 7))[
            "text"] == text
        assert await streamed(client, {**SEEDED, "speculative": False}) == text
        # A sampled request without a seed is told the one it was drawn with.
        unseeded = {key: value for key, value in SEEDED.items() if key != "seed"}
        drawn = await final(client, unseeded)
        assert isinstance(drawn["seed"], int), drawn
        again = await beside(daemon, client, {**unseeded, "seed": drawn["seed"]}, 2)
        assert again["text"] == drawn["text"]


@pytest.mark.asyncio
@pytest.mark.timeout(1800)
async def test_smollm2_edit_is_the_same_with_speculation_on_and_off() -> None:
    config = {**REPRODUCIBLE, "model": {"reproducible": True, "path": str(smollm2_path()),
                                        "n_ctx": 4096}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        off = await final(client, {**EDIT, "speculative": False, "cache_prompt": False})
        on = await final(client, {**EDIT, "cache_prompt": False})
        # The edit copies most of the module: drafts are made and taken.
        assert on["usage"]["accepted_tokens"] > 0, on["usage"]
        assert on["text"] == off["text"]
        assert (await beside(daemon, client, EDIT, 3))["text"] == off["text"]
        assert await streamed(client, EDIT) == off["text"]


REQUESTS: list[dict[str, Any]] = [
    {"prompt": STORY, "temperature": 0.0, "max_tokens": 24},
    {"prompt": "The history of the city of", "temperature": 0.7, "seed": 7, "max_tokens": 24},
    {"prompt": PREFIX + QUESTION_1, "temperature": 0.0, "max_tokens": 16},
    {"prompt": "Dear diary, today I", "temperature": 1.0, "seed": 99, "max_tokens": 24},
]


async def _texts_in_waves(daemon: Daemon, order: list[int], waves: list[int],
                          speculative: list[bool]) -> dict[int, str]:
    """The requests of `order`, sent in waves (each wave's at once, on connections of
    their own), each with speculation as drawn; their texts by index."""
    texts: dict[int, str] = {}

    async def one(index: int) -> None:
        async with daemon.client() as client:
            done = await final(client, {**REQUESTS[index],
                                        "speculative": speculative[index]})
            texts[index] = done["text"]

    start = 0
    for size in waves:
        await asyncio.gather(*(one(index) for index in order[start:start + size]))
        start += size
    return texts


@pytest.mark.timeout(1800)
def test_any_order_and_concurrency_gives_each_request_its_bytes() -> None:
    with BackgroundDaemon(REPRODUCIBLE) as background:
        daemon = background.daemon
        alone = background.run(_texts_in_waves(daemon, [0, 1, 2, 3], [1, 1, 1, 1],
                                                [False] * 4), WAIT_S)

        @settings(max_examples=5, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(st.randoms(use_true_random=False), st.lists(st.booleans(), min_size=4,
                                                          max_size=4))
        def check(rng: random.Random, speculative: list[bool]) -> None:
            order = list(range(len(REQUESTS)))
            rng.shuffle(order)
            waves: list[int] = []
            while sum(waves) < len(order):
                waves.append(rng.randint(1, len(order) - sum(waves)))
            texts = background.run(_texts_in_waves(daemon, order, waves, speculative), WAIT_S)
            assert texts == alone

        check()
