"""Background responses end to end, through the real `openai` SDK: created `queued` and
answered at once, polled with GET to `completed` (the answer a response made at once
gives), cancelled while running (its generation abandoned, its slot freed), and the
errors OpenAI gives for what cannot be cancelled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest_asyncio

from tests.kit.http import MODEL_ID, WAIT_S, Endpoint, endpoint, module_test, raises

QUESTION = "Name three colors of the rainbow."
POLL_S = 0.05


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tcp() -> AsyncIterator[Endpoint]:
    # Reproducible mode: the background answer, which reuses the first one's cached
    # prompt, must give its bytes.
    async with endpoint({"openai": {"listen": "127.0.0.1:0"}, "server": {"slots": 1},
                         "model": {"reproducible": True}}) as found:
        yield found


async def polled(client: openai.AsyncOpenAI, response_id: str) -> Any:
    """The response once it has ended: polling is how a client follows one (bounded)."""
    deadline = time.monotonic() + 3 * WAIT_S
    while True:
        response = await client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, response
        await asyncio.sleep(POLL_S)


@module_test
async def test_a_background_response_is_polled_to_completed(tcp: Endpoint) -> None:
    options: dict[str, Any] = {"model": MODEL_ID, "input": QUESTION, "max_output_tokens": 24,
                               "temperature": 0, "metadata": {"k": "v"}}
    async with tcp.sdk() as client:
        at_once = await client.responses.create(**options)
        queued = await client.responses.create(**options, background=True)
        assert queued.status == "queued" and queued.background is True
        assert queued.output == [] and queued.id.startswith("resp_")
        done = await polled(client, queued.id)
        items = [item async for item in client.responses.input_items.list(queued.id)]
        # Ended: cancelling changes nothing, and says so.
        error = await raises(client.responses.cancel(queued.id), openai.BadRequestError)
        assert "completed" in error.message or "incomplete" in error.message
        error = await raises(client.responses.cancel(at_once.id), openai.BadRequestError)
        assert "background" in error.message
        await raises(client.responses.cancel("resp_unknown"), openai.NotFoundError)
        error = await raises(client.responses.create(**options, background=True, stream=True),
                             openai.BadRequestError)
        assert error.param == "stream"
        error = await raises(client.responses.create(**options, background=True, store=False),
                             openai.BadRequestError)
        assert error.param == "store"
    assert done.status == at_once.status and done.background is True
    assert done.output_text == at_once.output_text and done.metadata == {"k": "v"}
    assert [item.content[0].text for item in items] == [QUESTION]  # type: ignore[union-attr]


@module_test
async def test_cancel_ends_a_running_background_response(tcp: Endpoint) -> None:
    before = await tcp.stats()
    async with tcp.sdk() as client:
        running = await client.responses.create(
            model=MODEL_ID, background=True, max_output_tokens=4000, temperature=0,
            input="Count from 1 to 2000, one number per line.",
            extra_body={"stop": ["NEVER-SAID"]})
        cancelled = await client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and cancelled.id == running.id
        # Cancelled again: the same answer; and it stays cancelled.
        again = await client.responses.cancel(running.id)
        assert again.status == "cancelled"
        stats = await tcp.wait_stats(lambda stats: stats["requests"]["by_outcome"]["cancelled"]
                                     > before["requests"]["by_outcome"]["cancelled"])
        assert stats["tokens"]["generated"] - before["tokens"]["generated"] < 4000
        assert (await client.responses.retrieve(running.id)).status == "cancelled"
        # The slot is free: the next response runs.
        after = await client.responses.create(model=MODEL_ID, input=QUESTION,
                                              max_output_tokens=4)
        assert after.status in ("completed", "incomplete")
        # A running one deleted is cancelled first, then gone.
        doomed = await client.responses.create(
            model=MODEL_ID, background=True, max_output_tokens=4000,
            input="Count from 1 to 2000, one number per line.")
        await client.responses.delete(doomed.id)
        await raises(client.responses.retrieve(doomed.id), openai.NotFoundError)
