"""The window layers attend from the first cell their window reaches
(scripts/llama-patches/swa-window-cells-*.patch), and that changes no number.

The daemon keeps a full-size sliding-window cache, so on the default model (Gemma 3: most
layers see the last 512 positions) a long context's window layers used to scan every
cell, masked. Patched, each ubatch's views and mask start at the first cell some token
of it can see, in whole 256-cell pads. The cells left out are masked for every token, so
attention sums exactly the same: with the row-invariant kernels (reproducible mode) a
long prompt's greedy reply and its logprobs are the same bits as with every cell
scanned (SFCORE_KV_SCAN_ALL=1, read by the patch at start-up). A real daemon each way.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.kit import REPLY_TIMEOUT_S, done_of, running_daemon

WAIT_S = REPLY_TIMEOUT_S * 10  # a hang bound: a loaded 2-core machine is slow
CONFIG: dict[str, Any] = {"model": {"reproducible": True}, "server": {"slots": 2}}
WORDS = ["river", "stone", "window", "garden", "market", "silver", "engine", "letter",
         "summer", "morning", "violin", "harbor", "lantern", "meadow", "copper", "thunder"]


def _request() -> dict[str, Any]:
    rng = random.Random(5)
    # About 1500 tokens: the window of the last ubatches and of every decoded token
    # starts past the first pads.
    text = " ".join(rng.choice(WORDS) for _ in range(1400))
    return {"op": "generate", "prompt": text + "\nTo sum up,", "max_tokens": 24,
            "temperature": 0.0, "logprobs": 3, "cache_prompt": False}


async def _reply(env: dict[str, str]) -> tuple[str, list[Any], int]:
    async with running_daemon(CONFIG, env=env) as daemon, daemon.client() as client:
        lines = await client.request({**_request(), "id": 1, "stream": False},
                                     timeout=WAIT_S)
    done = done_of(lines)
    assert done["finish_reason"] in ("length", "stop"), done
    return done["text"], done["logprobs"], done["usage"]["prompt_tokens"]


@pytest.mark.asyncio
async def test_skipping_the_cells_before_the_window_changes_no_bit() -> None:
    windowed = await _reply({})
    scanned = await _reply({"SFCORE_KV_SCAN_ALL": "1"})
    assert windowed[2] > 1024
    assert windowed == scanned
