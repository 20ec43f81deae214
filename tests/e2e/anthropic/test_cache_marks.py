"""Messages' `cache_control` marks end to end: the real daemon with its prompt store, the
real `anthropic` SDK. A marked prefix is pinned in the store; usage splits the prompt
into what the cache gave (`cache_read_input_tokens`), what this request wrote to it
(`cache_creation_input_tokens`) and the rest (`input_tokens`), which add up to
count_tokens' count; the `cache` op shows what the store did.

Each test has its own daemon and store folder (one slot, no disk tier unless it says):
what a turn reads depends on what the store and the slot hold.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
import pytest_asyncio

from tests.kit.http import Endpoint, endpoint
from tests.kit.prompt_store import cache_dir

pytestmark = pytest.mark.asyncio
__all__ = ["cache_dir"]  # the fixture

KEY = "cache-key"
WAIT_S = 180.0
GREEDY = {"temperature": 0}
EPHEMERAL = {"type": "ephemeral"}


def system_text(topic: str) -> str:
    """A system prompt of some 500 tokens of its own, from its first word."""
    return " ".join(f"{topic} rule {i}: the {('red', 'green', 'blue', 'amber')[i % 4]} "
                    f"{topic.lower()} weighs {i * 7 % 101} grams." for i in range(40))


A, B, C, D = (system_text(topic) for topic in ("Anchor", "Bridge", "Castle", "Delta"))


def config(directory: Path, **cache: Any) -> dict[str, Any]:
    return {"openai": {"listen": "127.0.0.1:0", "api_key": KEY},
            "cache": {"dir": str(directory), "min_tokens": 64, "disk_mb": 0, **cache},
            "server": {"slots": 1}, "model": {"n_ctx": 4096}}


def sdk(found: Endpoint) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=found.url, api_key=KEY, max_retries=0,
                                    timeout=WAIT_S)


def marked(text: str, ttl: str | None = None) -> dict[str, Any]:
    control = {**EPHEMERAL, "ttl": ttl} if ttl else EPHEMERAL
    return {"type": "text", "text": text, "cache_control": control}


def unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with their blocks' marks taken off (a client keeps its last ones)."""
    return [{**message, "content": [{key: value for key, value in block.items()
                                     if key != "cache_control"}
                                    for block in message["content"]]}
            if isinstance(message["content"], list) else message for message in messages]


async def turn(client: anthropic.AsyncAnthropic, **body: Any) -> tuple[int, Any]:
    """count_tokens' count of the body, and its message (greedy)."""
    counted = await client.messages.count_tokens(model="m", **body)
    made = await client.messages.create(model="m", max_tokens=6, extra_body=GREEDY, **body)
    usage = made.usage
    assert usage.cache_read_input_tokens is not None
    assert usage.cache_creation_input_tokens is not None
    assert (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens) == counted.input_tokens, usage
    return counted.input_tokens, made


async def states(found: Endpoint) -> list[dict[str, Any]]:
    async with found.daemon.client() as client:
        listing = await client.final({"op": "cache"})
    assert listing["type"] == "cache", listing
    found_states: list[dict[str, Any]] = listing["states"]
    return found_states


@pytest_asyncio.fixture
async def daemon(cache_dir: Path) -> AsyncIterator[Endpoint]:
    async with endpoint(config(cache_dir)) as found:
        yield found


async def test_a_marked_conversation_writes_on_turn_one_and_reads_after(
        daemon: Endpoint) -> None:
    system = [marked(A)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [marked("Which rule is the heaviest?")]}]
    reads, writes = [], []
    async with sdk(daemon) as client:
        for number in range(4):
            _, made = await turn(client, system=system, messages=messages)
            reads.append(made.usage.cache_read_input_tokens)
            writes.append(made.usage.cache_creation_input_tokens)
            # The mark at the end of the last user text: what the store now holds
            # pinned, whether this turn wrote it or the cache gave it.
            mark = made.usage.cache_read_input_tokens + made.usage.cache_creation_input_tokens
            pinned = {state["tokens"]: state["pinned_s"] for state in await states(daemon)}
            assert 290 <= pinned.get(mark, 0) <= 300, (mark, pinned)
            messages = [*unmarked(messages),
                        {"role": "assistant", "content": made.content[0].text},
                        {"role": "user", "content": [marked(f"And rule {number}?")]}]
    # Turn one wrote both marks' prefixes (an empty slot: nothing read but the
    # slot's first tokens); every later turn read at least what the turn before wrote.
    assert writes[0] > 400 and reads[0] < 8, (reads, writes)
    for before in range(3):
        assert reads[before + 1] >= reads[before] + writes[before], (reads, writes)
        assert 0 < writes[before + 1] < 32, (reads, writes)
    # A tool mark, with the system unmarked: the same prefix, already pinned.
    async with sdk(daemon) as client:
        _, made = await turn(client, system=A, messages=[
            {"role": "user", "content": "Which rule is the heaviest?"}], tools=[{
                "name": "weigh", "input_schema": {"type": "object"},
                "cache_control": EPHEMERAL}])
        assert made.usage.cache_read_input_tokens > 0
        assert made.usage.cache_creation_input_tokens > 0


async def test_the_stream_splits_the_prompt_in_message_delta(daemon: Endpoint) -> None:
    body: dict[str, Any] = {"system": [marked(B, "1h")], "messages": [
        {"role": "user", "content": "Which rule is the lightest?"}]}
    async with sdk(daemon) as client:
        counted = (await client.messages.count_tokens(model="m", **body)).input_tokens
        async with client.messages.stream(model="m", max_tokens=4, extra_body=GREEDY,
                                          **body) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
    start = next(event for event in events if event.type == "message_start")
    assert start.message.usage.input_tokens == counted
    delta = next(event for event in events if event.type == "message_delta")
    usage = final.usage
    assert usage.cache_creation_input_tokens == delta.usage.cache_creation_input_tokens > 400
    assert usage.input_tokens == delta.usage.input_tokens
    assert (usage.input_tokens + usage.cache_creation_input_tokens
            + (usage.cache_read_input_tokens or 0)) == counted
    # The one-hour mark: pinned for an hour.
    mark = usage.cache_creation_input_tokens + (usage.cache_read_input_tokens or 0)
    pinned = {state["tokens"]: state["pinned_s"] for state in await states(daemon)}
    assert 3500 < pinned.get(mark, 0) <= 3600, (mark, pinned)


async def test_a_marked_prefix_outlives_pressure_that_evicts_an_unmarked_one(
        cache_dir: Path) -> None:
    # RAM for three states of these prompts (each some 9.7 MB on the test model, one
    # a prompt): another prompt's states evict the ones before them, least recently
    # used first.
    async with endpoint(config(cache_dir, ram_mb=30)) as found, sdk(found) as client:
        question = [{"role": "user", "content": "Which rule is the heaviest?"}]
        _, first = await turn(client, system=[marked(A)], messages=question)
        pinned = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
        _, plain = await turn(client, system=B, messages=question)
        assert plain.usage.cache_creation_input_tokens == 0
        for other in (C, D):
            await turn(client, system=other, messages=question)
        kept = await states(found)
        assert any(state["tokens"] == pinned and state["pinned_s"] > 0 for state in kept), kept
        assert not any("Bridge" in state["preview"] for state in kept), kept
        stats = await found.stats()
        assert stats["cache"]["ram_evicted"] > 0, stats["cache"]
        # The marked conversation comes back from the store; the unmarked one does not.
        _, again = await turn(client, system=[marked(A)], messages=question)
        assert again.usage.cache_read_input_tokens == pinned, again.usage
        assert again.usage.cache_creation_input_tokens == 0
        _, plain_again = await turn(client, system=B, messages=question)
        assert plain_again.usage.cache_read_input_tokens < 16, plain_again.usage


async def test_a_marked_conversation_reads_its_prefix_after_a_restart(cache_dir: Path) -> None:
    body: dict[str, Any] = {"system": [marked(C)], "messages": [
        {"role": "user", "content": [marked("Which rule is the heaviest?")]}]}
    async with endpoint(config(cache_dir, disk_mb=256)) as found, sdk(found) as client:
        _, first = await turn(client, **body)
        written = first.usage.cache_creation_input_tokens
        assert written > 400
    async with endpoint(config(cache_dir, disk_mb=256)) as found, sdk(found) as client:
        _, again = await turn(client, **body)
        # Read from a marked prefix's file (the system's, where a restore gives a cold
        # run's bytes, or the user text's); both are stored: nothing is written.
        assert again.usage.cache_read_input_tokens > 400
        assert again.usage.cache_creation_input_tokens == 0
        pinned = {state["tokens"] for state in await states(found) if state["pinned_s"]}
        assert first.usage.cache_read_input_tokens + written in pinned, pinned


async def test_cache_control_is_checked_and_counted_as_anthropic_does(
        daemon: Endpoint) -> None:
    async with daemon.http() as http:
        headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
        for control, mention in [({"type": "persistent"}, "cache_control.type"),
                                 ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl")]:
            response = await http.post("/v1/messages", headers=headers, content=json.dumps({
                "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "hi", "cache_control": control}]}]}))
            assert response.status_code == 400, response.text
            assert mention in response.json()["error"]["message"], response.text
        response = await http.post("/v1/messages", headers=headers, content=json.dumps({
            "model": "m", "max_tokens": 2, "system": [marked("a"), marked("b")],
            "messages": [{"role": "user", "content": [marked("c"), marked("d"),
                                                      marked("e")]}]}))
        assert response.status_code == 400, response.text
        assert "A maximum of 4 blocks with cache_control" in response.json()["error"]["message"]
