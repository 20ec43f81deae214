"""Attention as matrix products for a long prompt's full steps (`[model] matmul_attention`,
llama/attnprobe.py, engine/attnchoice.py, scripts/llama-patches/matmul-attention.patch):
the real daemon reads a prompt with them as it does with flash attention, and measures
once where they pay.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/llama/test_attnprobe.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kit import done_of, running_daemon

daemon_test = pytest.mark.asyncio
# Three full steps of n_ubatch (512) rows and a rest, one slot, no drafts.
PROMPT_WORDS = 1800
CONFIG: dict[str, Any] = {"server": {"slots": 1}, "speculative": {"mode": "off"}}


def long_prompt() -> str:
    words = ["river", "stone", "lantern", "orchard", "copper", "meadow", "violin", "harbor",
             "thunder", "quiet", "saddle", "marble", "pepper", "window", "garden", "silver"]
    return " ".join(words[(index * 7) % len(words)] for index in range(PROMPT_WORDS))


async def first_token(config: dict[str, Any]) -> tuple[dict[str, Any], str]:
    async with running_daemon(config) as daemon, daemon.client() as client:
        done = done_of(await client.request(
            {"prompt": long_prompt(), "max_tokens": 1, "temperature": 0, "logprobs": 5,
             "cache_prompt": False, "stream": False}, timeout=180))
        log = daemon.log
    assert done["usage"]["prompt_tokens"] > 3 * 512
    return done["logprobs"][0], log


@daemon_test
async def test_a_prompt_read_with_matrix_products_gives_flash_attentions_next_token() -> None:
    product, log = await first_token({**CONFIG, "model": {"n_ctx": 4096,
                                                          "matmul_attention": "on"}})
    assert "matmul attention (on): steps of 512 prompt rows over 0-" in log
    flash, log = await first_token({**CONFIG, "model": {"n_ctx": 4096,
                                                        "matmul_attention": "off"}})
    assert "matmul attention (off): none" in log
    assert product["token"] == flash["token"]
    assert abs(product["logprob"] - flash["logprob"]) < 0.05
    ranked = {entry["token"] for entry in product["top_logprobs"][:3]}
    assert len(ranked & {entry["token"] for entry in flash["top_logprobs"]}) >= 2
    # Other sums, other bits: the products did read the prompt.
    assert [entry["logprob"] for entry in product["top_logprobs"]] != [
        entry["logprob"] for entry in flash["top_logprobs"]]


@daemon_test
async def test_auto_measures_once_and_a_later_start_reads_the_choice(tmp_path: Path) -> None:
    config = {**CONFIG, "model": {"n_ctx": 4096, "matmul_attention": "auto"},
              "cache": {"dir": str(tmp_path / "prompts")}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        done = done_of(await client.request(
            {"prompt": long_prompt(), "max_tokens": 4, "temperature": 0,
             "cache_prompt": False}, timeout=180))
        assert done["usage"]["completion_tokens"] >= 1
        log = daemon.log
    assert "matmul attention (measured" in log
    kept = list((tmp_path / "step-costs").glob("attention-*.json"))
    async with running_daemon(config) as again:
        if "kept for later starts" in log:
            assert len(kept) == 1, kept
            assert "matmul attention (kept)" in again.log
        else:  # measured while the machine was busy: for that run only
            assert "for this run only" in log and kept == []
            assert "matmul attention (measured" in again.log
