"""A short request beside a long prompt: a step that only reads prompts stops as soon as a
short interactive request (one physical batch: n_ubatch tokens) arrives (steploop.py),
keeps the whole ubatches it read, and the long prompt reads on after the short request's
prompt. Checked on a real daemon: the short request finishes before the long one's first
token, the stop is counted, and the long reply keeps the bytes it has alone (reproducible
mode: row-invariant kernels, so the batch shapes do not move a byte). Without that mode
flash attention's tiled path asks the callback between its tiles too, so a stop lands
inside a node; that the long prompt reads on as it would alone is checked there as well.
"""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import pytest

from tests.kit import REPLY_TIMEOUT_S, Client, Daemon, done_of, running_daemon
from tests.kit.faults import poll_until

WAIT_S = REPLY_TIMEOUT_S * 10  # a hang bound: a loaded 2-core machine is slow
# Steps of 1024 prompt rows in ubatches of 256: the second step of the long prompt is
# seconds of work, and a stop keeps whole ubatches.
CONFIG: dict[str, Any] = {"model": {"reproducible": True, "n_batch": 1024, "n_ubatch": 256},
                          "server": {"slots": 2}, "cache": {"enabled": False}}
WORDS = ["river", "stone", "window", "garden", "market", "silver", "engine", "letter",
         "summer", "morning", "violin", "harbor", "lantern", "meadow", "copper", "thunder",
         "pencil", "orchard", "candle", "village"]


def long_prompt(seed: int, words: int = 1500) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "\nIn short,"


async def metric(client: Client, name: str) -> float:
    text = (await client.final({"op": "metrics"}))["text"]
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, text
    return float(found.group(1))


async def read_stream(client: Client, order: list[str], name: str) -> list[dict[str, Any]]:
    """The request's lines; its first token's and its done's arrival go into `order`."""
    lines: list[dict[str, Any]] = []
    while True:
        line = await client.recv(WAIT_S)
        assert line is not None, lines
        lines.append(line)
        if line["type"] == "token" and not any(x["type"] == "token" for x in lines[:-1]):
            order.append(f"{name} first token")
        if line["type"] in ("done", "error"):
            order.append(f"{name} done")
            return lines


@pytest.mark.asyncio
async def test_a_short_request_stops_a_long_prompt_step_and_both_keep_their_bytes() -> None:
    prompt = long_prompt(7)
    long_request = {"op": "generate", "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                    "stream": True, "cache_prompt": False}
    async with running_daemon(CONFIG) as daemon:
        alone = await _alone(daemon, long_request)
        # The long prompt's first 1024-row step is done: its second is being read.
        long_lines, short_lines, order, preempted = await _short_beside_long(
            daemon, long_request, steps_before=1, short_tokens=4)
    assert done_of(short_lines)["usage"]["completion_tokens"] >= 1
    assert order.index("short done") < order.index("long first token"), order
    assert preempted >= 1
    assert _text(long_lines) == alone
    assert done_of(long_lines)["usage"]["prompt_tokens"] > 1024


# The daemon's defaults (row bits may follow the batch shapes), its callback asked
# between flash attention's tiles at every chance: a stop lands inside a node as often.
FAST_CONFIG: dict[str, Any] = {"server": {"slots": 2}, "cache": {"enabled": False}}
ASK_EVERY_TILE = {"GGML_CPU_ABORT_ASK_US": "0"}
# Another sequence's cells in the pool reorder flash attention's sums (f16 partials): a
# logprob drifts by a tenth at most here; a step's rows lost or left half-written, far more.
LOGPROB_DRIFT = 0.5


@pytest.mark.asyncio
async def test_a_stop_inside_a_step_leaves_the_long_prompt_its_exact_context() -> None:
    """Without reproducible mode: a 512-row step at depth stopped for a short request
    (inside an attention node, as often as not), the long prompt read on from the cells
    kept. Its first token's distribution is the one it has alone, to the noise of the
    cells' layout; the bits themselves are checked in tests/e2e/llama/test_abort_in_node.py
    (a stopped step leaves the cache as it was)."""
    request = {"op": "generate", "prompt": long_prompt(23, words=2500), "max_tokens": 2,
               "temperature": 0.0, "stream": True, "logprobs": 5, "cache_prompt": False}
    async with running_daemon(FAST_CONFIG, env=ASK_EVERY_TILE) as daemon:
        async with daemon.client() as client:
            alone = await client.request({**request, "id": "alone"}, timeout=WAIT_S)
        # Two 512-row steps done: the third, at depth, is being read.
        long_lines, short_lines, order, preempted = await _short_beside_long(
            daemon, request, steps_before=2, short_tokens=2)
    assert preempted >= 1
    assert order.index("short done") < order.index("long first token"), order
    assert done_of(short_lines)["usage"]["completion_tokens"] >= 1
    assert done_of(long_lines)["usage"]["prompt_tokens"] == \
        done_of(alone)["usage"]["prompt_tokens"] > 3 * 512
    first_alone = _first_entry(alone)
    beside = {entry["token"]: entry["logprob"]
              for entry in _first_entry(long_lines)["top_logprobs"]}
    assert first_alone["token"] in beside, (first_alone, beside)
    assert abs(beside[first_alone["token"]] - first_alone["logprob"]) < LOGPROB_DRIFT


async def _short_beside_long(daemon: Daemon, long_request: dict[str, Any], *,
                             steps_before: int, short_tokens: int
                             ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str],
                                        float]:
    """The long request sent, a short one once `steps_before` of its steps are done: both
    replies, the order of their first tokens and ends, and the stops counted."""
    async with daemon.client() as long_client, daemon.client() as short_client, \
            daemon.client() as probe:
        steps = await metric(probe, "sfcore_decode_steps_total")
        await long_client.send({**long_request, "id": "long"})
        await poll_until(lambda: metric(probe, "sfcore_decode_steps_total"),
                         lambda value: value >= steps + steps_before, timeout=WAIT_S,
                         what="the long prompt's first steps")
        order: list[str] = []
        await short_client.send({"op": "generate", "id": "short", "stream": True,
                                 "prompt": "The capital of France is",
                                 "max_tokens": short_tokens, "temperature": 0.0})
        long_lines, short_lines = await asyncio.wait_for(asyncio.gather(
            read_stream(long_client, order, "long"),
            read_stream(short_client, order, "short")), WAIT_S)
        preempted = await metric(probe, "sfcore_preempted_steps_total")
    return long_lines, short_lines, order, preempted


def _first_entry(lines: list[dict[str, Any]]) -> dict[str, Any]:
    entries = [entry for line in lines if line["type"] == "token" for entry in line["logprobs"]]
    assert entries, lines
    return entries[0]


async def _alone(daemon: Daemon, request: dict[str, Any]) -> str:
    async with daemon.client() as client:
        return _text(await client.request({**request, "id": "alone"}, timeout=WAIT_S))


def _text(lines: list[dict[str, Any]]) -> str:
    done = done_of(lines)
    assert done["finish_reason"] in ("length", "stop"), done
    return "".join(line["text"] for line in lines if line["type"] == "token") + done["text"]


@pytest.mark.asyncio
async def test_an_interactive_long_prompt_goes_ahead_of_a_background_one() -> None:
    """A long interactive prompt (past what a short request is) stops a step that reads
    only a background prompt, and its prompt is read first."""
    async with running_daemon(CONFIG) as daemon:
        async with daemon.client() as background, daemon.client() as interactive, \
                daemon.client() as probe:
            steps = await metric(probe, "sfcore_decode_steps_total")
            await background.send({"op": "generate", "id": "background", "stream": True,
                                   "prompt": long_prompt(11), "max_tokens": 4,
                                   "temperature": 0.0, "priority": "background"})
            await poll_until(lambda: metric(probe, "sfcore_decode_steps_total"),
                             lambda value: value >= steps + 1, timeout=WAIT_S,
                             what="the background prompt's first step")
            order: list[str] = []
            await interactive.send({"op": "generate", "id": "interactive", "stream": True,
                                    "prompt": long_prompt(12, words=900), "max_tokens": 4,
                                    "temperature": 0.0})
            background_lines, interactive_lines = await asyncio.wait_for(asyncio.gather(
                read_stream(background, order, "background"),
                read_stream(interactive, order, "interactive")), WAIT_S)
            preempted = await metric(probe, "sfcore_preempted_steps_total")
    assert done_of(interactive_lines)["usage"]["prompt_tokens"] > 512
    assert done_of(background_lines)["finish_reason"] in ("length", "stop")
    assert order.index("interactive first token") < order.index("background first token"), order
    assert preempted >= 1
