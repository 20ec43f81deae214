"""OpenAI's `prompt_cache_key` on the HTTP listener: the real daemon, the real `openai`
SDK. The key is checked (a string), and a request whose prompt no free slot shares
takes the slot its key last ran in rather than the least recently used one, which
holds another key's conversation."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.kit.http import KEY, Endpoint, endpoint, raises

pytestmark = pytest.mark.asyncio


def prompt(topic: str) -> list[Any]:
    text = " ".join(f"{topic} note {i}: the {topic.lower()} count is {i * 7 % 31}."
                    for i in range(20))
    return [{"role": "user", "content": text}]


async def chat(found: Endpoint, topic: str, key: str) -> Any:
    async with found.sdk() as client:
        return await client.chat.completions.create(
            model="m", messages=prompt(topic), max_tokens=2, temperature=0,
            extra_body={"prompt_cache_key": key})


async def test_a_key_takes_its_own_slot_and_leaves_another_key_s_cache() -> None:
    config = {"openai": {"listen": "127.0.0.1:0", "api_key": KEY}, "server": {"slots": 2},
              "cache": {"enabled": False}}
    async with endpoint(config) as found:
        await chat(found, "Alpha", "alice")  # slot 0
        await chat(found, "Beta", "bob")  # slot 1
        await chat(found, "Alpha", "alice")  # slot 0 again, by its prefix: slot 1 is older
        # Nothing in common with either slot: alice's slot, not the least recently used.
        await chat(found, "Gamma", "alice")
        slots = (await found.stats())["slots"]
        assert sorted(slot["requests"] for slot in slots) == [1, 3], slots
        again = await chat(found, "Beta", "bob")
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached is not None and cached >= again.usage.prompt_tokens - 2, again.usage
        async with found.sdk() as client:
            for bad in (5, ["a"], "x" * 1025):
                error = await raises(client.chat.completions.create(
                    model="m", messages=prompt("Alpha"), max_tokens=1,
                    extra_body={"prompt_cache_key": bad}), openai.BadRequestError)
                assert "prompt_cache_key" in str(error), error
                error = await raises(client.responses.create(
                    model="m", input="hi", max_output_tokens=1,
                    extra_body={"prompt_cache_key": bad}), openai.BadRequestError)
                assert "prompt_cache_key" in str(error), error
