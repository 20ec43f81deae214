"""Chat Completions' and Completions' replies: their chunks and their whole bodies."""

from __future__ import annotations

import secrets
import time

from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.httpd.reply import SSE_TYPE, event
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
)

DONE_EVENT = b"data: [DONE]\n\n"


class _Identity:
    """What every chunk and body of one reply repeats; `id` is also the request's id
    in the daemon (its log lines)."""

    # OpenAI's id prefix for the object this API answers with.
    prefix = ""
    content_type = SSE_TYPE

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

    def closing(self, done: Result) -> bytes:
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

    def whole(self, done: Result) -> bytes:
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

    def closing(self, done: Result) -> bytes:
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

    def whole(self, done: Result) -> bytes:
        return encoder.encode(Completion(
            object="text_completion", id=self.id, created=self.created, model=self.model,
            system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(
                text=done.text,
                logprobs=(translate.legacy_logprobs(done.logprobs, 0)
                          if done.logprobs is not None else None),
                finish_reason=translate.finish_reason(done))],
            usage=translate.usage(done)))
