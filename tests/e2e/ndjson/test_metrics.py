"""Prometheus metrics (core/metrics.py): GET /metrics, the `metrics` op and
`sfcore stats --prometheus`, read with prometheus_client's reference parser.

The live test makes real generations (NDJSON and HTTP) and checks what the scrapes
say against the replies' own usage: token totals, one first-token and one queue-wait
observation per generation, one inter-token gap per token after a generation's first;
counters never go back between two scrapes; buckets are cumulative up to +Inf.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/core/test_metrics.py.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sfcore_client import AsyncClient, Client

from sfcore_daemon.core.metrics import CONTENT_TYPE
from tests.kit import REPO, running_daemon
from tests.kit import Client as NdjsonClient

API_KEY = "metrics-test-key"
SLOTS = 2
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=60)
RUN_TIMEOUT_S = 120

# name -> (type, label names); every series the daemon promises (docs/operations.md).
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sfcore_requests": ("counter", ("api", "op")),
    "sfcore_generations": ("counter", ("outcome",)),
    "sfcore_errors": ("counter", ("code",)),
    "sfcore_prompt_tokens": ("counter", ()),
    "sfcore_cached_prompt_tokens": ("counter", ()),
    "sfcore_generated_tokens": ("counter", ()),
    "sfcore_drafted_tokens": ("counter", ()),
    "sfcore_accepted_tokens": ("counter", ()),
    "sfcore_prompt_cache_hits": ("counter", ("tier",)),
    "sfcore_prompt_store_bytes": ("gauge", ("tier",)),
    "sfcore_prompt_store_states": ("gauge", ("tier",)),
    "sfcore_queue_depth": ("gauge", ()),
    "sfcore_slots": ("gauge", ()),
    "sfcore_slots_busy": ("gauge", ()),
    "sfcore_decode_steps": ("counter", ()),
    "sfcore_step_tokens": ("counter", ()),
    "sfcore_decode_threads": ("gauge", ()),
    "sfcore_decode_thread_changes": ("counter", ()),
    "sfcore_connections": ("gauge", ()),
    "sfcore_connections_accepted": ("counter", ()),
    "sfcore_connections_rejected": ("counter", ()),
    "sfcore_http_connections": ("gauge", ()),
    "sfcore_http_connections_accepted": ("counter", ()),
    "sfcore_http_connections_closed": ("counter", ("reason",)),
    "sfcore_http_responses": ("counter", ("status",)),
    "sfcore_first_token_seconds": ("histogram", ()),
    "sfcore_inter_token_gap_seconds": ("histogram", ()),
    "sfcore_queue_wait_seconds": ("histogram", ()),
    "sfcore_process_resident_memory_bytes": ("gauge", ()),
    "sfcore_uptime_seconds": ("gauge", ()),
}
HISTOGRAMS = [name for name, (kind, _) in SERIES.items() if kind == "histogram"]


def parse(text: str) -> tuple[dict[str, Any], Samples]:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in families.values() for sample in family.samples}
    return families, samples


def check_scrape(text: str) -> Samples:
    """Every promised series, of its type, with its labels; buckets cumulative."""
    families, samples = parse(text)
    missing = sorted(set(SERIES) - set(families))
    assert not missing, missing
    for name, (kind, labels) in SERIES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.documentation, name
        for sample in family.samples:
            if kind != "histogram":
                assert set(sample.labels) == set(labels), (name, sample)
    for name in HISTOGRAMS:
        buckets = [sample for sample in families[name].samples
                   if sample.name == f"{name}_bucket"]
        assert buckets[-1].labels["le"] == "+Inf"
        counts = [bucket.value for bucket in buckets]
        assert counts == sorted(counts), (name, counts)
        bounds = [float(bucket.labels["le"]) for bucket in buckets]
        assert bounds == sorted(bounds) and bounds[0] <= 0.001 and bounds[-2] >= 60, bounds
        assert counts[-1] == samples[(f"{name}_count", ())], name
    for tier in ("slot", "ram", "disk"):
        assert (("sfcore_prompt_cache_hits_total", (("tier", tier),))) in samples
    for tier in ("ram", "disk"):
        assert (("sfcore_prompt_store_bytes", (("tier", tier),))) in samples
    return samples


def counter_values(text: str) -> Samples:
    families, samples = parse(text)
    counters = {name for name, family in families.items()
                if family.type in ("counter", "histogram")}
    return {key: number for key, number in samples.items()
            if any(key[0].startswith(name) for name in counters)}


async def generate(client: NdjsonClient, prompts: Iterable[str]) -> list[dict[str, Any]]:
    """Pipelined greedy generations (they share the slots); their `done` usage."""
    messages = [{"id": f"m{number}", "prompt": prompt, "max_tokens": 6, "temperature": 0}
                for number, prompt in enumerate(prompts)]
    await client.send(*messages)
    usages = []
    for _ in messages:
        reply = await client.reply()
        assert reply[-1]["type"] == "done", reply
        usages.append(reply[-1]["usage"])
    return usages


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics",
                           headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == CONTENT_TYPE
        return await response.text()


async def completion(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.post(f"{url}/v1/completions",
                            headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"model": "any", "prompt": "The sea is", "max_tokens": 5,
                                  "temperature": 0}) as response:
        assert response.status == 200, await response.text()
        usage: dict[str, Any] = (await response.json())["usage"]
        return usage


def client_scrapes(path: str) -> tuple[str, str]:
    """The blocking client's metrics(), and `sfcore stats --prometheus`."""
    with Client(path, timeout=30) as client:
        text = client.metrics()
    result = subprocess.run(
        [sys.executable, "-m", "sfcore_client", "stats", "--prometheus", "--socket", path],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO, check=False,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0 and not result.stderr, result.stderr
    return text, result.stdout


@pytest.mark.asyncio
async def test_scrapes_count_what_the_generations_did() -> None:
    config = {"server": {"slots": SLOTS},
              "openai": {"listen": "127.0.0.1:0", "api_key": API_KEY}}
    async with running_daemon(config) as daemon, daemon.client() as client, \
            aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session:
        match = re.search(r"OpenAI API on (http://\S+)", "\n".join(daemon.notifications))
        assert match, daemon.notifications
        url = match.group(1)

        async with session.get(f"{url}/metrics") as response:
            assert response.status == 401  # a scrape sends the key like any client
            assert (await response.json())["error"]["code"] == "invalid_api_key"

        usages = await generate(client, ["Once upon a time", "The capital of France is",
                                         "1, 2, 3,"])
        first = await scrape(session, url)
        samples = check_scrape(first)
        expect_generations(samples, usages)
        assert value(samples, "sfcore_requests_total", op="generate", api="ndjson") == len(usages)
        assert value(samples, "sfcore_requests_total", op="metrics", api="http") == 1
        assert value(samples, "sfcore_slots") == SLOTS
        assert value(samples, "sfcore_slots_busy") == 0
        assert value(samples, "sfcore_queue_depth") == 0
        assert value(samples, "sfcore_connections") == 1  # this NDJSON client
        # The scrape without a key; this scrape's own 200 is counted once it is written.
        assert value(samples, "sfcore_http_responses_total", status="401") == 1
        assert value(samples, "sfcore_http_responses_total", status="200") == 0
        assert value(samples, "sfcore_http_connections") >= 1  # the session's
        steps = value(samples, "sfcore_decode_steps_total")
        assert steps >= 1
        # Each prompt's evaluated tokens, and every token but a generation's last, were
        # rows of a step (drafted rows come on top).
        assert value(samples, "sfcore_step_tokens_total") >= sum(
            usage["prompt_tokens"] - cached(usage) + usage["completion_tokens"] - 1
            for usage in usages)
        assert value(samples, "sfcore_process_resident_memory_bytes") > 100 << 20
        assert value(samples, "sfcore_uptime_seconds") > 0

        # The same text from the op, the Python clients and `sfcore stats --prometheus`.
        op = await client.final({"op": "metrics"})
        assert op["type"] == "metrics"
        async with AsyncClient(daemon.socket_path, timeout=30) as aio:
            aio_text = await aio.metrics()
        blocking_text, cli_text = await asyncio.wait_for(
            asyncio.to_thread(client_scrapes, daemon.socket_path), RUN_TIMEOUT_S)
        for text in (op["text"], aio_text, blocking_text, cli_text):
            expect_generations(check_scrape(text), usages)

        usages += await generate(client, ["Water boils at", "Roses are red,"])
        usages.append(await completion(session, url))
        second = await scrape(session, url)
        later = check_scrape(second)
        expect_generations(later, usages)
        # Two scrapes over HTTP, four through the socket (the op, both clients, the CLI).
        assert value(later, "sfcore_requests_total", op="metrics", api="http") == 2
        assert value(later, "sfcore_requests_total", op="metrics", api="ndjson") == 4
        assert value(later, "sfcore_requests_total", op="generate", api="completions") == 1
        assert value(later, "sfcore_decode_steps_total") > steps
        before, after = counter_values(first), counter_values(second)
        assert before.keys() == after.keys()
        went_back = {key: (before[key], after[key]) for key in before
                     if after[key] < before[key]}
        assert not went_back, went_back
        grew = [key for key in before if after[key] > before[key]]
        assert len(grew) >= 10, grew


def expect_generations(samples: Samples, usages: list[dict[str, Any]]) -> None:
    """What the scrape says of the generations, exactly, against their replies' usage."""
    count = len(usages)
    generated = sum(usage["completion_tokens"] for usage in usages)
    outcomes = sum(number for (name, _), number in samples.items()
                   if name == "sfcore_generations_total")
    assert outcomes == count
    assert value(samples, "sfcore_generated_tokens_total") == generated
    assert value(samples, "sfcore_prompt_tokens_total") == sum(
        usage["prompt_tokens"] for usage in usages)
    assert value(samples, "sfcore_cached_prompt_tokens_total") == sum(
        cached(usage) for usage in usages)
    assert value(samples, "sfcore_first_token_seconds_count") == count
    assert value(samples, "sfcore_queue_wait_seconds_count") == count
    # One gap per token after each generation's first.
    assert value(samples, "sfcore_inter_token_gap_seconds_count") == sum(
        max(usage["completion_tokens"] - 1, 0) for usage in usages)
    assert value(samples, "sfcore_first_token_seconds_sum") > 0
    assert value(samples, "sfcore_errors_total", code="invalid_request") == 0


def cached(usage: dict[str, Any]) -> int:
    """Cached prompt tokens in an NDJSON `done` usage or an OpenAI one."""
    details = usage.get("prompt_tokens_details") or {}
    return int(usage.get("cached_tokens", details.get("cached_tokens", 0)))


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]

