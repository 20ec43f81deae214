"""`truncation` end to end, through the real `openai` SDK on a small context: with
"disabled" (the default) a conversation past the context is the context error it always
was; with "auto" its oldest messages are dropped until it fits, the response says
`truncation: "auto"`, the log says what was dropped, and the chain goes on."""

from __future__ import annotations

import openai
import pytest

from tests.kit.http import MODEL_ID, endpoint, raises

pytestmark = pytest.mark.asyncio

N_CTX = 1024
# A few hundred tokens: three turns of it overflow N_CTX.
FILLER = " ".join(f"Note {number}: the meeting moved to room {number % 7}."
                  for number in range(30))


async def test_auto_drops_the_oldest_items_and_disabled_refuses() -> None:
    config = {"openai": {"listen": "127.0.0.1:0"}, "model": {"n_ctx": N_CTX}}
    async with endpoint(config) as found, found.sdk() as client:
        previous = None
        for turn in range(2):
            reply = await client.responses.create(
                model=MODEL_ID, instructions="Answer briefly.", previous_response_id=previous,
                input=f"{FILLER} Turn {turn}.", max_output_tokens=8, truncation="auto")
            assert reply.truncation == "auto"
            previous = reply.id
        assert reply.usage is not None
        last_input = reply.usage.input_tokens
        error = await raises(client.responses.create(
            model=MODEL_ID, instructions="Answer briefly.", previous_response_id=previous,
            input=f"{FILLER} Turn 2.", max_output_tokens=8), openai.BadRequestError)
        assert error.code == "context_length_exceeded"
        cut = await client.responses.create(
            model=MODEL_ID, instructions="Answer briefly.", previous_response_id=previous,
            input=f"{FILLER} Turn 2.", max_output_tokens=8, truncation="auto")
        assert cut.truncation == "auto" and cut.status in ("completed", "incomplete")
        assert cut.usage is not None
        assert cut.usage.input_tokens + 8 <= N_CTX
        # One turn in, one (the first) out: no longer than the turn before.
        assert cut.usage.input_tokens <= last_input + 8
        # What the model read is what the next turn starts from.
        following = await client.responses.create(
            model=MODEL_ID, instructions="Answer briefly.", previous_response_id=cut.id,
            input="Which room?", max_output_tokens=8, truncation="auto")
        assert following.usage is not None
        assert following.usage.input_tokens > cut.usage.input_tokens
        # Every item is still listed: truncation changes what the model reads only.
        items = [item async for item in client.responses.input_items.list(cut.id)]
        assert len(items) == 5
        log = await found.daemon.log_with("truncation auto dropped the oldest")
    assert f"{cut.id}: truncation auto dropped the oldest 2 of 5 messages" in log
