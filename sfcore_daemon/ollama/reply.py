"""Ollama's replies: NDJSON lines as the text is generated, or one JSON body.

Each streamed line is `{"model", "created_at", "message": {...} | "response", "done":
false}`; the last has `done: true`, `done_reason` and the counts (durations in
nanoseconds). A chat's calls come whole on a line of their own before the last, their
arguments an object. A failure once streaming is an `{"error": ...}` line, which
Ollama's clients raise as an error.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.ollama.schema import (
    ChatLine,
    ErrorBody,
    FunctionCallOut,
    GenerateLine,
    Line,
    LogprobOut,
    MessageOut,
    ToolCallOut,
    TopLogprobOut,
)

NDJSON_TYPE: Final = "application/x-ndjson"


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def message(error: ApiError) -> str:
    """Ollama's error text: the message, led by the field it names if it does not say it."""
    if error.param is not None and error.param not in error.message:
        return f"{error.param}: {error.message}"
    return error.message


def line(body: Any) -> bytes:
    return encoder.encode(body) + b"\n"


def done_reason(done: Result) -> str:
    """"length" for an answer cut short (max_tokens, a JSON document closed early to
    fit them, a stopping daemon), else "stop" (calls included, as Ollama says)."""
    return "length" if done.cut_short else "stop"


def counts(done: Result) -> dict[str, Any]:
    """The last line's fields. The model is loaded once at start-up: load_duration 0."""
    timings, usage = done.timings, done.usage
    return {
        "done": True, "done_reason": done_reason(done),
        "total_duration": round(timings.total_ms * 1e6), "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": round(timings.prompt_ms * 1e6),
        "eval_count": usage.completion_tokens,
        "eval_duration": round(timings.decode_ms * 1e6),
    }


def logprobs(entries: list[TokenLogprob] | None) -> list[LogprobOut] | None:
    if not entries:
        return None
    return [LogprobOut(token=entry.text, logprob=entry.logprob, bytes=entry.bytes,
                       top_logprobs=[TopLogprobOut(token=top.text, logprob=top.logprob,
                                                   bytes=top.bytes)
                                     for top in entry.top_logprobs])
            for entry in entries]


def tool_calls(done: Result) -> list[ToolCallOut] | None:
    if not done.tool_calls:
        return None
    return [ToolCallOut(function=FunctionCallOut(name=call.function.name,
                                                 arguments=call.function.arguments))
            for call in done.tool_calls]


class _Shape:
    """What both replies share (`httpd.reply.ReplyShape`)."""

    content_type = NDJSON_TYPE

    def __init__(self, model: str) -> None:
        self.model = model

    def opening(self) -> bytes:
        return b""

    def failure(self, error: ApiError) -> bytes:
        return line(ErrorBody(error=message(error)))


class ChatShape(_Shape):
    """/api/chat: `message` objects."""

    def _line(self, message: MessageOut, done: bool = False, **fields: Any) -> Line:
        return ChatLine(model=self.model, created_at=now(), message=message, done=done,
                        **fields)

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        if text or entries:
            into += line(self._line(MessageOut(role="assistant", content=text),
                                    logprobs=logprobs(entries)))

    def closing(self, done: Result) -> bytes:
        out = b""
        calls = tool_calls(done)
        if calls:
            out = line(self._line(MessageOut(role="assistant", content="", tool_calls=calls)))
        # Entries no text line carried (tokens whose text never came out) ride here.
        return out + line(self._line(MessageOut(role="assistant", content=""),
                                     logprobs=logprobs(done.logprobs), **counts(done)))

    def whole(self, done: Result) -> bytes:
        return encoder.encode(self._line(
            MessageOut(role="assistant", content=done.text, tool_calls=tool_calls(done)),
            logprobs=logprobs(done.logprobs), **counts(done)))


class GenerateShape(_Shape):
    """/api/generate: `response` text."""

    def _line(self, response: str, done: bool = False, **fields: Any) -> Line:
        return GenerateLine(model=self.model, created_at=now(), response=response, done=done,
                            **fields)

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        if text or entries:
            into += line(self._line(text, logprobs=logprobs(entries)))

    def closing(self, done: Result) -> bytes:
        return line(self._line("", logprobs=logprobs(done.logprobs), **counts(done)))

    def whole(self, done: Result) -> bytes:
        return encoder.encode(self._line(done.text, logprobs=logprobs(done.logprobs),
                                         **counts(done)))


def loaded(model: str, chat: bool) -> Line:
    """The reply to an empty request, Ollama's way of loading a model: done at once."""
    if chat:
        return ChatLine(model=model, created_at=now(), done=True, done_reason="load",
                        message=MessageOut(role="assistant", content=""))
    return GenerateLine(model=model, created_at=now(), done=True, done_reason="load",
                        response="")
