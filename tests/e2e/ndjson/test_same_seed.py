"""The same seeded request, the same bytes, whatever the daemon served before.

What carried over between requests was the KV pool: the cells other slots kept decide
where llama.cpp puts a new request's cells and how many cells attention spans, and those
pick and partition its attention kernels (one query row over 512 or more cells is split
by cell ranges across threads; a prompt's rows take the cells in tiles), so the float
sums, and near-ties, moved with the history. A request that reuses nothing and starts
alone now gets an empty pool (docs/protocol.md, "Reproducibility and the prompt cache").
In reproducible mode the kernels are row-invariant and a sequence's cells follow its
positions, so a request keeps its bytes beside other streams too (test_reproducible.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.kit import REPLY_TIMEOUT_S, Client, Daemon, done_of, running_daemon

pytestmark = pytest.mark.asyncio

WAIT_S = REPLY_TIMEOUT_S * 10  # a hang bound: a loaded 2-core machine is slow
# Past 64 tokens, so that the prompt is read in llama.cpp's tiled attention, whose tiles
# are cell ranges: where its cells start among the pool's cells changes the sums.
STORY = ("The village at the edge of the forest kept a lantern in every window through the "
         "long winter, and the children knew the names of all the foxes that came to the "
         "gardens at night: the old one with the grey tail, the quick one, and the small "
         "red one that never came near the houses. Write a short story about the small red "
         "fox on the night it finds a lantern lying in the snow.")
SAMPLED = {"prompt": STORY, "temperature": 0.9, "seed": 11, "max_tokens": 32,
           "cache_prompt": False, "stream": False}
GREEDY = {key: value for key, value in SAMPLED.items() if key != "seed"} | {"temperature": 0.0}
# Other requests: their prompts stay in their slots' cells (cache_prompt true), one long
# enough that the pool spans more than 512 cells.
LONG = " ".join(f"Note {i}: the garden gate creaks when the wind turns west." for i in range(45))
OTHERS = [LONG + "\nSummary:", "A short guide to growing tomatoes:",
          "The main causes of the French Revolution were", "Here is a recipe for bread:"]


async def text_of(client: Client, request: dict[str, Any]) -> str:
    done = done_of(await client.request(request, timeout=WAIT_S))
    assert done["finish_reason"] in ("length", "stop"), done
    return str(done["text"])


async def serve_others(daemon: Daemon, tokens: int) -> None:
    """The other requests, each on a connection of its own, at once."""
    async def one(index: int, prompt: str) -> None:
        async with daemon.client() as client:
            await text_of(client, {"prompt": prompt, "max_tokens": tokens + 5 * index,
                                   "temperature": 0.7, "seed": index, "stream": False})

    await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(OTHERS)))


@pytest.mark.timeout(1800)
async def test_a_request_that_reuses_nothing_gives_a_fresh_daemons_bytes_after_others() -> None:
    """Default config, speculation on: the same request with `cache_prompt: false`,
    sampled and greedy, gives the text it gave on the fresh daemon after the daemon
    served other, different requests (whose cells stay cached), again and again."""
    async with running_daemon({"server": {"slots": 4}}) as daemon, daemon.client() as client:
        sampled, greedy = await text_of(client, SAMPLED), await text_of(client, GREEDY)
        assert sampled and greedy and sampled != greedy
        await serve_others(daemon, 16)
        slots = (await client.final({"op": "stats"}))["slots"]
        assert sum(slot["cached_tokens"] > 0 for slot in slots) >= 3, slots
        assert await text_of(client, SAMPLED) == sampled
        assert await text_of(client, GREEDY) == greedy
        await serve_others(daemon, 8)
        assert await text_of(client, SAMPLED) == sampled
        assert await text_of(client, SAMPLED) == sampled


@pytest.mark.timeout(1800)
async def test_with_the_store_of_earlier_answers_a_seeded_request_keeps_its_bytes() -> None:
    """The store (on by default; the harness turns it off) holds what every request
    generated: a request sent again would draft its first answer in other batch shapes.
    One that names its seed never drafts from it, so its bytes stay its own after its
    own answer and other requests' answers are in the store."""
    config = {"server": {"slots": 4}, "speculative": {"store_tokens": 262144}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        info = await client.final({"op": "info"})
        assert info["config"]["speculative"]["store_tokens"] == 262144
        sampled = await text_of(client, SAMPLED)
        await serve_others(daemon, 16)
        assert await text_of(client, SAMPLED) == sampled
        assert await text_of(client, SAMPLED) == sampled


@pytest.mark.timeout(1800)
async def test_reproducible_mode_gives_the_same_bytes_alone_and_beside_streaming_clients(
) -> None:
    """`reproducible = true`: the seeded request alone, then sent while another client
    streams and two more are sent, gives the same bytes (it runs in the batch beside
    them)."""
    request = {**SAMPLED, "cache_prompt": True}
    config = {"model": {"reproducible": True}, "server": {"slots": 4},
              "generation": {"max_tokens": 256}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        alone = await text_of(client, request)
        assert alone
        streamers = [await daemon.connect() for _ in range(3)]
        try:
            others = [{"prompt": prompt, "max_tokens": 24, "temperature": 0.8, "seed": index,
                       "stream": True} for index, prompt in enumerate(OTHERS[1:])]
            # One streams; the others and the request wait their turns beside it.
            await streamers[0].start_streaming(others[0])
            for streamer, other in zip(streamers[1:], others[1:], strict=True):
                await streamer.send(other)
            beside = await text_of(client, request)
            for streamer in streamers:
                lines = await streamer.reply(timeout=WAIT_S)
                assert lines[-1]["type"] == "done", lines[-1]
        finally:
            for streamer in streamers:
                await streamer.close()
        assert beside == alone
        assert await text_of(client, request) == alone
