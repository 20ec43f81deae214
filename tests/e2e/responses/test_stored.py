"""Stored responses kept across a restart, end to end: the real daemon and the real
`openai` SDK. A conversation chained by `previous_response_id` resumes after the daemon
is started again on the same cache folder, warm (the prompt store's states are on disk
too) and with the greedy bytes of a daemon that never stopped; a damaged record file is
a 404, never served; the input items are listed a page at a time as OpenAI does."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.kit.http import MODEL_ID, WAIT_S, Endpoint, endpoint, raises
from tests.kit.prompt_store import cache_dir

pytestmark = pytest.mark.asyncio
__all__ = ["cache_dir"]  # the fixture

# Past [cache] min_tokens, so the prompt store keeps the turns' states.
INSTRUCTIONS = "You are a helpful assistant. " + " ".join(
    f"Rule {number}: answer in plain words, and keep each answer short."
    for number in range(40))
QUESTIONS = ("My name is Ann.", "What is my name?", "Say it once more.", "Spell it.")


def config(directory: Path) -> dict[str, Any]:
    # Reproducible mode: a restored state and a slot's own cells give the same bytes
    # whatever the kernels' batch shapes were (docs/performance/reproducible.md).
    return {"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 1},
            "cache": {"dir": str(directory)}, "model": {"reproducible": True}}


async def turns(found: Endpoint, questions: tuple[str, ...],
                previous: str | None = None) -> list[Any]:
    replies = []
    async with found.sdk().with_options(timeout=3 * WAIT_S) as client:
        for question in questions:
            reply = await client.responses.create(
                model=MODEL_ID, instructions=INSTRUCTIONS, input=question,
                previous_response_id=previous, max_output_tokens=12, temperature=0)
            replies.append(reply)
            previous = reply.id
    return replies


def record(directory: Path, response_id: str) -> Path:
    return directory / "responses" / f"{response_id}.resp"


async def test_a_chained_conversation_resumes_after_a_restart(cache_dir: Path,
                                                              tmp_path: Path) -> None:
    async with endpoint(config(cache_dir)) as found:
        before = await turns(found, QUESTIONS[:3])
    for reply in before:
        path = record(cache_dir, reply.id)
        assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((cache_dir / "responses").stat().st_mode) == 0o700
    # The first two records damaged (the third holds the whole conversation).
    first = record(cache_dir, before[0].id)
    first.write_bytes(first.read_bytes()[:-10])
    second = record(cache_dir, before[1].id)
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x20
    second.write_bytes(bytes(data))

    async with endpoint(config(cache_dir)) as found:
        (resumed,) = await turns(found, QUESTIONS[3:], previous=before[2].id)
        async with found.sdk() as client:
            kept = await client.responses.retrieve(before[2].id)
            assert kept.output_text == before[2].output_text
            for damaged in before[:2]:
                error = await raises(client.responses.retrieve(damaged.id),
                                     openai.NotFoundError)
                assert error.code == "not_found"
            listed = [item async for item in client.responses.input_items.list(
                resumed.id, order="asc", limit=2)]
        log = await found.daemon.log_with("dropped: its file")
    assert "truncated" in log and "checksum" in log
    assert not first.exists() and not second.exists()
    assert resumed.previous_response_id == before[2].id
    assert resumed.usage is not None and before[2].usage is not None
    # Warm: a state of the last turn's prompt (kept at a line start past the turn
    # before's) came back from the prompt store's disk.
    assert before[1].usage is not None
    assert resumed.usage.input_tokens_details.cached_tokens >= before[1].usage.input_tokens
    # The whole conversation: each turn's question and answer, then this turn's question.
    assert [(item.type, getattr(item, "role", None)) for item in listed] == \
        [("message", "user"), ("message", "assistant")] * 3 + [("message", "user")]
    assert listed[-1].content[0].text == QUESTIONS[3]  # type: ignore[union-attr]
    assert listed[1].content[0].text == before[0].output_text  # type: ignore[union-attr]

    # A daemon that never stopped gives the same greedy bytes.
    async with endpoint(config(tmp_path / "other")) as found:
        straight = await turns(found, QUESTIONS)
    assert [reply.output_text for reply in straight[:3]] == \
        [reply.output_text for reply in before]
    assert straight[3].output_text == resumed.output_text
    assert straight[3].usage is not None
    assert straight[3].usage.input_tokens == resumed.usage.input_tokens


async def test_input_items_pages_deleting_and_store_false(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    async with endpoint(config(directory)) as found, found.sdk() as client:
        first = await client.responses.create(
            model=MODEL_ID, max_output_tokens=4, temperature=0,
            input=[{"role": "developer", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                   {"role": "user", "content": "there"}])
        items = [item async for item in client.responses.input_items.list(first.id)]
        assert [item.content[0].text for item in items] == \
            ["there", "Hi", "Be brief."]  # type: ignore[union-attr]
        page = await client.responses.input_items.list(first.id, limit=2, order="asc")
        assert [item.id for item in page.data] == [item.id for item in items[::-1][:2]]
        assert page.has_more
        async with found.http() as http:
            raw = (await http.get(f"/v1/responses/{first.id}/input_items",
                                  params={"limit": 1})).json()
            assert raw["object"] == "list" and raw["has_more"] is True
            assert raw["first_id"] == raw["last_id"] == items[0].id
            bad = await http.get(f"/v1/responses/{first.id}/input_items",
                                 params={"limit": 1000})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
            missing = await http.get("/v1/responses/resp_nope/input_items")
            assert missing.status_code == 404
        unstored = await client.responses.create(model=MODEL_ID, input="Hi", store=False,
                                                 max_output_tokens=2)
        assert not record(directory, unstored.id).exists()
        await client.responses.delete(first.id)
        await raises(client.responses.input_items.list(first.id), openai.NotFoundError)
    assert not list((directory / "responses").iterdir())
