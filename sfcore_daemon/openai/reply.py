"""One HTTP request's reply: a generation's events as server-sent events or one body.

`HttpReply` is the `ReplySink` a generation writes into: streamed text is encoded at
once into `pending` (chunks in OpenAI's shape) and the route's task, woken by
`ready`, hands it to aiohttp, which holds it to the socket's pace. A client that
stops reading lets `pending` grow; past `server.max_output_buffer_bytes` its
generation is abandoned, as a stalled NDJSON client's is. `ChatShape` and
`CompletionShape` say what the chunks and the whole body of each API look like.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from sfcore_daemon.openai import translate
from sfcore_daemon.openai.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    ToolCallDelta,
    encoder,
)
from sfcore_daemon.openai.translate import ApiError
from sfcore_daemon.serve.protocol import DoneReply, TokenLogprob

if TYPE_CHECKING:
    from sfcore_daemon.serve.output import Generation

DONE_EVENT = b"data: [DONE]\n\n"


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


class ReplyShape(Protocol):
    """How one API writes a generation: its stream's chunks and its whole body."""

    def opening(self) -> bytes: ...

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None: ...

    def closing(self, done: DoneReply) -> bytes: ...

    def whole(self, done: DoneReply) -> bytes: ...

    def failure(self, error: ApiError) -> bytes: ...


class _Identity:
    """What every chunk and body of one reply repeats; `id` is also the request's id
    in the daemon (its log lines)."""

    # OpenAI's id prefix for the object this API answers with.
    prefix = ""

    def __init__(self, model: str, fingerprint: str, include_usage: bool) -> None:
        self.id = f"{self.prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    def failure(self, error: ApiError) -> bytes:
        # OpenAI's SDKs raise an event that holds an `error` as an API error.
        return event(encoder.encode(error.body()))


class ChatShape(_Identity):
    """/v1/chat/completions: `chat.completion` and `chat.completion.chunk` objects."""

    prefix = "chatcmpl"

    def _chunk(self, choice: ChatChunkChoice) -> bytes:
        return event(encoder.encode(ChatCompletionChunk(
            object="chat.completion.chunk", id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.fingerprint, choices=[choice])))

    def opening(self) -> bytes:
        # OpenAI's first chunk names the role; the text follows in the next ones.
        return self._chunk(ChatChunkChoice(delta=Delta(role="assistant", content=""),
                                           logprobs=None, finish_reason=None))

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        into += self._chunk(ChatChunkChoice(
            delta=Delta(content=text),
            logprobs=translate.chat_logprobs(entries) if entries is not None else None,
            finish_reason=None))

    def closing(self, done: DoneReply) -> bytes:
        calls = b""
        made = translate.tool_calls(done)
        if made:
            # Each call whole in one delta (OpenAI's clients join a call's deltas by index).
            calls = self._chunk(ChatChunkChoice(
                delta=Delta(tool_calls=[
                    ToolCallDelta(index=index, id=call.id, function=call.function)
                    for index, call in enumerate(made)]),
                logprobs=None, finish_reason=None))
        # Entries no text chunk carried (tokens whose text never came out) ride here.
        last = calls + self._chunk(ChatChunkChoice(
            delta=Delta(), finish_reason=translate.finish_reason(done),
            logprobs=translate.chat_logprobs(done.logprobs) if done.logprobs else None))
        if self.include_usage:
            last += event(encoder.encode(ChatCompletionChunk(
                object="chat.completion.chunk", id=self.id, created=self.created, model=self.model,
                system_fingerprint=self.fingerprint, choices=[],
                usage=translate.usage(done))))
        return last + DONE_EVENT

    def whole(self, done: DoneReply) -> bytes:
        return encoder.encode(ChatCompletion(
            id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[ChatChoice(
                message=AssistantMessage(
                    role="assistant",
                    # OpenAI's answer that is only calls has no content.
                    content=done.text if done.text or not done.tool_calls else None,
                    tool_calls=translate.tool_calls(done)),
                logprobs=(translate.chat_logprobs(done.logprobs)
                          if done.logprobs is not None else None),
                finish_reason=translate.finish_reason(done))],
            usage=translate.usage(done)))


class CompletionShape(_Identity):
    """/v1/completions: `text_completion` objects, streamed and whole."""

    prefix = "cmpl"

    def __init__(self, model: str, fingerprint: str, include_usage: bool) -> None:
        super().__init__(model, fingerprint, include_usage)
        # Characters streamed so far: the next token's text_offset.
        self._offset = 0

    def _chunk(self, choice: CompletionChoice) -> bytes:
        return event(encoder.encode(Completion(
            object="text_completion", id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.fingerprint, choices=[choice])))

    def opening(self) -> bytes:
        return b""

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        logprobs = (translate.legacy_logprobs(entries, self._offset)
                    if entries is not None else None)
        self._offset += len(text)
        into += self._chunk(CompletionChoice(text=text, logprobs=logprobs,
                                             finish_reason=None))

    def closing(self, done: DoneReply) -> bytes:
        last = self._chunk(CompletionChoice(
            text="", finish_reason=translate.finish_reason(done),
            logprobs=(translate.legacy_logprobs(done.logprobs, self._offset)
                      if done.logprobs else None)))
        if self.include_usage:
            last += event(encoder.encode(Completion(
                object="text_completion", id=self.id, created=self.created, model=self.model,
                system_fingerprint=self.fingerprint, choices=[],
                usage=translate.usage(done))))
        return last + DONE_EVENT

    def whole(self, done: DoneReply) -> bytes:
        return encoder.encode(Completion(
            object="text_completion", id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(
                text=done.text,
                logprobs=(translate.legacy_logprobs(done.logprobs, 0)
                          if done.logprobs is not None else None),
                finish_reason=translate.finish_reason(done))],
            usage=translate.usage(done)))


class HttpReply:
    """The sink of one HTTP request's generation (`output.ReplySink`, and what
    admission needs of a client: `gone`, `attach`). Event loop only."""

    def __init__(self, shape: ReplyShape, stream: bool, limit_bytes: int,
                 on_stalled: Callable[[HttpReply], None]) -> None:
        self.shape = shape
        self.stream = stream
        self._limit_bytes = limit_bytes
        self._on_stalled = on_stalled
        # Encoded chunks not yet handed to aiohttp.
        self.pending = bytearray()
        self.ready = asyncio.Event()
        # Set by done, error or close: nothing more comes.
        self.ended = False
        self.outcome: DoneReply | ApiError | None = None
        # The client hung up or stopped reading.
        self.gone = False
        self.generation: Generation | None = None
        # The request's connection: aborted when its client stops reading, which ends
        # a write stuck waiting for it to drain.
        self.transport: asyncio.Transport | None = None

    def attach(self, generation: Generation) -> None:
        self.generation = generation

    def token(self, text: str, logprobs: list[TokenLogprob] | None) -> None:
        self.shape.chunk(text, logprobs, self.pending)

    def flush(self) -> None:
        if len(self.pending) > self._limit_bytes and not self.gone:
            self.gone = True
            self.pending.clear()
            self._on_stalled(self)
            return
        if self.pending:
            self.ready.set()

    def done(self, reply: DoneReply) -> None:
        self._end(reply)

    def error(self, code: str, message: str) -> None:
        self._end(ApiError.from_code(code, message))

    def close(self) -> None:
        self._end(None)

    def _end(self, outcome: DoneReply | ApiError | None) -> None:
        if not self.ended:
            self.ended = True
            self.outcome = outcome
            self.ready.set()

    def take(self) -> bytes:
        """What is pending, and the stream's last events once the reply has ended."""
        data = bytes(self.pending)
        self.pending.clear()
        self.ready.clear()
        if self.ended and not self.gone:
            outcome = self.outcome
            if isinstance(outcome, DoneReply):
                data += self.shape.closing(outcome)
            elif isinstance(outcome, ApiError):
                data += self.shape.failure(outcome)
        return data
