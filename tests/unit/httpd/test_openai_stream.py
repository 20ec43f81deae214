"""A streamed HTTP reply always ends whole (issue 50): when the generation ends while a
write waits for a slow reader, the last chunks, the finish reason, the usage and
`[DONE]` still follow. First the interleaving forced on the write loop itself, then a
real slow reader against the real daemon.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/httpd/test_openai_stream.py.
"""

from __future__ import annotations

import asyncio

import pytest

from sfcore_daemon.core.result import Result, Timings, Usage
from sfcore_daemon.httpd.api import pump
from sfcore_daemon.httpd.reply import HttpReply
from sfcore_daemon.openai.shapes import DONE_EVENT, ChatShape
from tests.kit import REPLY_TIMEOUT_S
from tests.kit.http import sse_chunks

pytestmark = pytest.mark.asyncio


def _done(text: str) -> Result:
    return Result(
        id="r", text=text, finish_reason="length", stop_sequence=None, truncated=False,
        usage=Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=2, drafted_tokens=0,
                    accepted_tokens=0),
        timings=Timings(queued_ms=0, prompt_ms=1, prompt_tok_s=1, first_token_ms=1,
                        decode_ms=1, decode_tok_s=1, total_ms=1, cache_source="none"))


@pytest.mark.parametrize("ends_during_write", [1, 2])
async def test_a_reply_that_ends_while_a_write_waits_still_sends_its_closing(
        ends_during_write: int) -> None:
    reply = HttpReply(ChatShape("m", "fp", include_usage=True), True, 1 << 20, lambda _: None)
    reply.token("Hello", None)
    reply.flush()
    written: list[bytes] = []

    more = [" world", "!"][:ends_during_write]
    whole = "Hello" + "".join(more)

    async def slow_write(data: bytes) -> None:
        written.append(data)
        await asyncio.sleep(0)  # the reader is slow: the generation goes on meanwhile
        if more:
            reply.token(more.pop(0), None)
            reply.flush()
            if not more:
                reply.done(_done(whole))

    await asyncio.wait_for(pump(reply, slow_write), REPLY_TIMEOUT_S)
    stream = b"".join(written)
    assert stream.endswith(DONE_EVENT)
    chunks = sse_chunks(stream)
    text = "".join(chunk["choices"][0]["delta"].get("content") or ""
                   for chunk in chunks if chunk["choices"])
    assert text == whole
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]][-1] \
        == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2
