"""The draft gate (engine/draftgate.py): step costs by rows, the expected tokens of a
draft, the length that pays most; the costs file (engine/costsfile.py); and, live, a
daemon whose drafts are judged by the step costs it measured.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/engine/test_draftgate.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sfcore_daemon.engine import costsfile
from sfcore_daemon.llama.stepcost import (
    DEPTH_KEY,
    FAR_DEPTH_KEY,
    FAR_PROMPT_CELL_KEY,
    PROMPT_CELL_KEY,
    PROMPT_ROW_KEY,
    BusyMeter,
)
from tests.kit import done_of, merge, running_daemon

pytest_asyncio_mark = pytest.mark.asyncio(loop_scope="function")


COPY = {"prompt": "Copy this list exactly, one item a line:\nalpha\nbravo\ncharlie\ndelta\n"
                  "echo\nfoxtrot\ngolf\nhotel\nindia\njuliet\n\nCopy:\nalpha\nbravo\n",
        "max_tokens": 48}


async def info(daemon: Any) -> dict[str, Any]:
    async with daemon.client() as client:
        return await client.final({"op": "info"})


@pytest_asyncio_mark
async def test_a_daemon_measures_its_step_costs_once_and_judges_drafts_by_them(
        tmp_path: Path) -> None:
    measured = merge({}, {"speculative": {"policy": "measured"},
                          "cache": {"dir": str(tmp_path / "prompts")},
                          "server": {"slots": 1}})
    async with running_daemon(measured) as daemon:
        costs = (await info(daemon))["config"]["speculative"]
        assert costs["policy"] == "measured"
        ratios = {int(rows): ratio for rows, ratio in costs["step_costs"].items()}
        assert ratios[1] == 1.0 and set(range(1, 18)) | {32, 64} <= set(ratios)
        assert all(ratio > 0 for ratio in ratios.values())
        async with daemon.client() as client:
            plain = done_of(await client.request(
                {**COPY, "temperature": 0, "speculative": False, "cache_prompt": False}))
            fast = done_of(await client.request(
                {**COPY, "temperature": 0, "cache_prompt": False}))
        # Whatever the gate decided, the text is the model's: drafts of at most 3 rows
        # are bit-exact, and a longer one only where its costs say it pays.
        assert fast["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
        assert fast["usage"]["accepted_tokens"] <= fast["usage"]["drafted_tokens"]
        log = daemon.log
        assert "drafts judged by step costs" in log
    kept = list((tmp_path / "step-costs").glob("*.json"))
    if "kept for later starts" in log:
        assert len(kept) == 1, kept
        costs_kept = costsfile.load(kept[0])
        assert costs_kept is not None
        # A prompt row's cost, and by the cell up to DEPTH and past it: the default model
        # has window layers, so it is measured again at twice DEPTH.
        assert costs_kept[PROMPT_ROW_KEY] > 0
        assert {DEPTH_KEY, FAR_DEPTH_KEY, PROMPT_CELL_KEY, FAR_PROMPT_CELL_KEY} <= set(costs_kept)
    else:  # measured while the machine was busy: for that run only
        assert "for this run only" in log and kept == []
    async with running_daemon(measured) as again:
        again_costs = (await info(again))["config"]["speculative"]["step_costs"]
        if kept:  # the next start reads them instead of measuring
            assert again_costs == costs["step_costs"]
            assert "as measured before" in again.log
        else:
            assert "measured in" in again.log


@pytest_asyncio_mark
async def test_no_step_wider_than_the_daemon_makes_is_measured(tmp_path: Path) -> None:
    # llama.cpp aborts on a batch with more outputs than the context was made for
    # (slots + draft_max here): this config once killed the daemon at start-up.
    short = merge({}, {"speculative": {"policy": "measured", "draft_max": 8},
                       "cache": {"dir": str(tmp_path / "prompts")}, "server": {"slots": 2}})
    async with running_daemon(short) as daemon, daemon.client() as client:
        ratios = (await client.final({"op": "info"}))["config"]["speculative"]["step_costs"]
        assert done_of(await client.request({**COPY, "temperature": 0}))["usage"][
            "completion_tokens"] > 0
    assert 10 <= max(map(int, ratios)) < 32, ratios


# Pairs of requests (one plain, one drafting) at most, until the daemon has seen enough
# steps of each kind to say whether its step costs still fit (engine/costdrift.py): each
# pair adds about 40 one-row steps and, drafts of at most 8 priced as one row, about 6
# wide ones (11 pairs on the machine the test was written on).
_DRIFT_PAIRS = 40


@pytest_asyncio_mark
async def test_kept_step_costs_that_no_longer_fit_are_measured_again_at_the_next_start(
        tmp_path: Path) -> None:
    # The failpoint prices a step of any width as a one-row step, as a bad measurement
    # kept from an earlier start would: every draft then seems to pay, and the wide steps
    # the daemon serves run several times dearer than it was told.
    config = merge({}, {"speculative": {"policy": "measured", "draft_max": 8},
                        "cache": {"dir": str(tmp_path / "prompts")},
                        "server": {"slots": 1}, "runtime": {"adaptive_threads": False},
                        "generation": {"max_tokens": 48}})
    async with running_daemon(config, env={"SFCORE_FAILPOINT": "cheap_wide_steps"}) as daemon:
        ratios = (await info(daemon))["config"]["speculative"]["step_costs"]
        assert set(ratios.values()) == {1.0}, ratios
        async with daemon.client() as client:
            fresh = (await client.final({"op": "stats"}))["speculative"]
            assert fresh["step_costs_drift"] is None and not fresh["step_costs_drifted"]
            for pair in range(_DRIFT_PAIRS):
                for speculative in (False, True):
                    done = done_of(await client.request(
                        {**COPY, "prompt": f"{pair}. {COPY['prompt']}", "temperature": 0,
                         "speculative": speculative, "cache_prompt": False}))
                    assert done["usage"]["completion_tokens"] > 0
                stats = (await client.final({"op": "stats"}))["speculative"]
                if stats["step_costs_drift"] is not None:
                    break
            assert stats["drafted"] > 0
            assert stats["step_costs_drifted"] and stats["step_costs_drift"] > 1.25, stats
            log = await daemon.log_with("no longer fit this machine")
            # It still serves, with the costs it started with.
            assert done_of(await client.request({**COPY, "temperature": 0}))["usage"][
                "completion_tokens"] > 0
    if "kept for later starts" in log:
        assert "the kept costs were removed" in log
    else:  # measured while the machine was busy: nothing was kept
        assert "no kept costs to remove" in log
    assert list((tmp_path / "step-costs").glob("*.json")) == []
    async with running_daemon(config) as again:
        assert "as measured before" not in again.log
        ratios = (await info(again))["config"]["speculative"]["step_costs"]
        # Measured anew: the widest step costs more than one row.
        assert ratios[max(ratios, key=int)] > 1.0, ratios


def test_the_busy_meter_sees_another_process_on_the_cpus() -> None:
    busy = BusyMeter()
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend = time.monotonic() + 0.6\n"
                              "while time.monotonic() < end: pass"])
    try:
        child.wait(timeout=30)
    finally:
        child.kill()
    # One of this machine's CPUs (at most 2 here, more elsewhere) for most of the time.
    assert busy.share() >= 0.5 / (os.cpu_count() or 1) * 0.5
