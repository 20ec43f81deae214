"""A Messages reply: Anthropic's stream events, or its `message` body.

The events are those Anthropic's SDKs parse (each an `event:` line naming its type and
a `data:` line): `message_start` (the usage's input_tokens already known: the prompt
was tokenized before the first event; how much of it the cache gives is known once it
is read, so `message_delta` carries the split, which the SDKs take over), `ping`, then
the blocks, each `content_block_start`, its deltas, `content_block_stop`: the text as
it is generated (`text_delta`), then each call whole once the answer has ended
(`input_json_delta` holding all of its input: a call is read, and checked, only when
complete), and last `message_delta` (stop_reason, stop_sequence, usage) and
`message_stop`. A failure after the first byte is an `error` event.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from sfcore_daemon.anthropic import translate
from sfcore_daemon.anthropic.errors import error_body
from sfcore_daemon.anthropic.schema import (
    BlockDelta,
    BlockStart,
    BlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageOut,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ToolUseBlock,
    encoder,
)
from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.httpd.reply import SSE_TYPE, HttpReply

if TYPE_CHECKING:
    from sfcore_daemon.core.generation import Generation


def sse(kind: str, data: bytes) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class MessagesShape:
    """How /v1/messages writes a generation (`httpd.reply.ReplyShape`)."""

    content_type = SSE_TYPE

    def __init__(self, model: str) -> None:
        self.id = translate.message_id()
        self.model = model
        # Set when the generation is admitted (MessagesReply.attach).
        self.input_tokens = 0
        # The index of the next block, and whether the text block is open.
        self._blocks = 0
        self._text_open = False

    def opening(self) -> bytes:
        start = MessageStart(message=MessageOut(
            id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
            usage=MessageUsage(input_tokens=self.input_tokens, output_tokens=0)))
        return (sse("message_start", encoder.encode(start))
                + sse("ping", encoder.encode(Ping())))

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        if not text:
            return
        if not self._text_open:
            into += self._start(TextBlock(text=""))
            self._text_open = True
        into += sse("content_block_delta", encoder.encode(
            BlockDelta(index=self._blocks - 1, delta=TextDelta(text=text))))

    def _start(self, block: TextBlock | ToolUseBlock) -> bytes:
        self._blocks += 1
        return sse("content_block_start", encoder.encode(
            BlockStart(index=self._blocks - 1, content_block=block)))

    def _stop(self) -> bytes:
        return sse("content_block_stop", encoder.encode(BlockStop(index=self._blocks - 1)))

    def closing(self, done: Result) -> bytes:
        out = bytearray()
        calls = translate.tool_uses(done)
        if self._text_open:
            out += self._stop()
        elif not calls:
            # An empty answer still has its (empty) text block, as the whole body does.
            out += self._start(TextBlock(text="")) + self._stop()
        for call in calls:
            out += self._start(ToolUseBlock(id=call.id, name=call.name, input={}))
            out += sse("content_block_delta", encoder.encode(BlockDelta(
                index=self._blocks - 1,
                delta=InputJsonDelta(partial_json=json.dumps(call.input,
                                                             ensure_ascii=False)))))
            out += self._stop()
        out += sse("message_delta", encoder.encode(MessageDelta(
            delta=StopDelta(stop_reason=translate.stop_reason(done),
                            stop_sequence=done.stop_sequence),
            usage=translate.usage(done))))
        out += sse("message_stop", encoder.encode(MessageStop()))
        return bytes(out)

    def whole(self, done: Result) -> bytes:
        return encoder.encode(MessageOut(
            id=self.id, model=self.model, content=translate.content(done),
            stop_reason=translate.stop_reason(done), stop_sequence=done.stop_sequence,
            usage=translate.usage(done)))

    def failure(self, error: ApiError) -> bytes:
        return sse("error", encoder.encode(error_body(error)))


class MessagesReply(HttpReply):
    """An HttpReply that tells its shape the prompt's size once admitted, for the
    stream's first event."""

    def attach(self, generation: Generation) -> None:
        super().attach(generation)
        if isinstance(self.shape, MessagesShape):
            self.shape.input_tokens = len(generation.job.prompt)
