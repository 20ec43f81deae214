"""A generation written as a Responses API reply.

`ResponsesShape` is the `reply.ReplyShape` of `/v1/responses`: streamed, the documented
event sequence (`response.created`, `response.in_progress`, the message item and its
text part as text comes, each function call item whole at the end, then
`response.completed`, or `response.incomplete` at max_output_tokens), each event with
its `sequence_number`; whole, one `response` object. A finished response with `store`
is handed to the store (store.py, through `keep`) before its last event is written, so
a client that names it in its next request finds it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from sfcore_daemon.core.request import FunctionCall, Message, ToolCall
from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.errors import ApiError, encoder
from sfcore_daemon.httpd.reply import SSE_TYPE
from sfcore_daemon.responses.schema import (
    ChosenToolIn,
    FunctionCallItem,
    FunctionToolOut,
    IncompleteDetails,
    InputTokensDetails,
    LogprobOut,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseErrorOut,
    ResponseObject,
    ResponsesRequest,
    ResponseTopLogprob,
    ResponseUsage,
    TextConfigOut,
    TextFormatOut,
)


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(payload) + b"\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesShape:
    """/v1/responses: `response` objects and their streamed events."""

    content_type = SSE_TYPE

    def __init__(self, model: str, body: ResponsesRequest,
                 keep: Callable[[ResponseObject, list[Message], int], None] | None) -> None:
        self.id = _new_id("resp")
        self._keep = keep
        self._sequence = 0
        self._message_id = ""
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] | None = None
        # The request's conversation (set once it is mapped) and what the response adds.
        self.conversation: list[Message] = []
        self.history_length = 0
        self.base = _base(self.id, model, body)
        # Numbered first, though written when the stream starts (after text may have
        # been encoded): the numbers follow the order the client reads.
        self._opening = (self._event("response.created", response=self.base)
                         + self._event("response.in_progress", response=self.base))

    # --- streamed ---

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return _sse(kind, payload)

    def opening(self) -> bytes:
        return self._opening

    def chunk(self, text: str, entries: list[TokenLogprob] | None, into: bytearray) -> None:
        if not self._message_id:
            into += self._open_message()
        self._text.append(text)
        if entries is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(entries)
        into += self._event("response.output_text.delta", item_id=self._message_id,
                            output_index=0, content_index=0, delta=text,
                            logprobs=_delta_logprobs(entries or []))

    def _open_message(self) -> bytes:
        self._message_id = _new_id("msg")
        item = OutputMessage(type="message", id=self._message_id, status="in_progress",
                             role="assistant", content=[])
        return (self._event("response.output_item.added", output_index=0, item=item)
                + self._event("response.content_part.added", item_id=self._message_id,
                              output_index=0, content_index=0,
                              part=OutputText(type="output_text", text="", annotations=[])))

    def closing(self, done: Result) -> bytes:
        data = b""
        response = self._finish(done)
        index = 0
        if self._message_id:
            message = response.output[0]
            assert isinstance(message, OutputMessage)
            part = message.content[0]
            data += (self._event("response.output_text.done", item_id=self._message_id,
                                 output_index=0, content_index=0, text=part.text,
                                 logprobs=_delta_logprobs(self._logprobs or []))
                     + self._event("response.content_part.done", item_id=self._message_id,
                                   output_index=0, content_index=0, part=part)
                     + self._event("response.output_item.done", output_index=0, item=message))
            index = 1
        for item in response.output[index:]:
            assert isinstance(item, FunctionCallItem)
            added = msgspec.structs.replace(item, status="in_progress", arguments="")
            data += (self._event("response.output_item.added", output_index=index, item=added)
                     + self._event("response.function_call_arguments.delta", item_id=item.id,
                                   output_index=index, delta=item.arguments)
                     + self._event("response.function_call_arguments.done", item_id=item.id,
                                   output_index=index, arguments=item.arguments)
                     + self._event("response.output_item.done", output_index=index, item=item))
            index += 1
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        return data + self._event(kind, response=response)

    def failure(self, error: ApiError) -> bytes:
        failed = msgspec.structs.replace(
            self.base, status="failed",
            error=ResponseErrorOut(code=error.code or "server_error", message=error.message))
        return (self._event("error", code=error.code, message=error.message, param=error.param)
                + self._event("response.failed", response=failed))

    # --- whole ---

    def whole(self, done: Result) -> bytes:
        return encoder.encode(self._finish(done))

    def _finish(self, done: Result) -> ResponseObject:
        """The finished response, kept if asked (before the client can learn its id)."""
        output: list[OutputItem] = []
        # Streamed, the done reply holds no text: the chunks had it.
        text = "".join(self._text) if self._message_id else done.text
        if text or self._message_id:
            logprobs = self._logprobs if self._logprobs is not None else done.logprobs
            if self._logprobs is not None and done.logprobs:
                logprobs = [*self._logprobs, *done.logprobs]
            output.append(OutputMessage(
                type="message", id=self._message_id or _new_id("msg"), status="completed",
                role="assistant",
                content=[OutputText(type="output_text", text=text, annotations=[],
                                    logprobs=(_logprobs(logprobs) if logprobs is not None
                                              else None))]))
        for call in done.tool_calls or ():
            output.append(FunctionCallItem(
                type="function_call", id=_new_id("fc"), call_id=call.id,
                name=call.function.name, status="completed",
                arguments=json.dumps(call.function.arguments, ensure_ascii=False)))
        incomplete = done.cut_short
        counts = done.usage
        response = msgspec.structs.replace(
            self.base, status="incomplete" if incomplete else "completed",
            completed_at=None if incomplete else int(time.time()), output=output,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete
            else None,
            usage=ResponseUsage(
                input_tokens=counts.prompt_tokens, output_tokens=counts.completion_tokens,
                total_tokens=counts.prompt_tokens + counts.completion_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=counts.cached_tokens),
                output_tokens_details=OutputTokensDetails()))
        if self._keep is not None:
            answer = Message(role="assistant", content=text, tool_calls=[
                ToolCall(id=call.id, function=FunctionCall(name=call.function.name,
                                                           arguments=call.function.arguments))
                for call in done.tool_calls] if done.tool_calls else None)
            conversation = [*self.conversation, answer]
            self._keep(response, conversation, len(conversation) - self.history_length)
            self._keep = None
        return response


def _base(response_id: str, model: str, body: ResponsesRequest) -> ResponseObject:
    """The response as it starts: what the request asked for, echoed."""
    text_format = body.text.format if body.text is not None else None
    choice = body.tool_choice
    return ResponseObject(
        id=response_id, object="response", created_at=int(time.time()), status="in_progress",
        completed_at=None, error=None, incomplete_details=None,
        instructions=body.instructions, max_output_tokens=body.max_output_tokens, model=model,
        output=[], parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id,
        reasoning={"effort": None, "summary": None}, store=body.store,
        temperature=body.temperature, top_p=body.top_p, top_logprobs=body.top_logprobs,
        text=TextConfigOut(format=TextFormatOut(
            type=text_format.type if text_format is not None else "text",
            name=text_format.name or None if text_format is not None else None,
            json_schema=(text_format.json_schema
                         if text_format is not None and isinstance(text_format.json_schema, dict)
                         else None),
            strict=text_format.strict if text_format is not None else None)),
        tool_choice=({"type": "function", "name": choice.name or ""}
                     if isinstance(choice, ChosenToolIn) else choice or "auto"),
        tools=[FunctionToolOut(type="function", name=tool.name or "",
                               description=tool.description, parameters=tool.parameters,
                               strict=tool.strict) for tool in body.tools or ()],
        truncation=body.truncation or "disabled", usage=None, metadata=body.metadata or {},
        background=bool(body.background))


def _logprobs(entries: list[TokenLogprob]) -> list[LogprobOut]:
    return [LogprobOut(token=entry.text, bytes=entry.bytes, logprob=entry.logprob,
                       top_logprobs=[ResponseTopLogprob(token=top.text, bytes=top.bytes,
                                                   logprob=top.logprob)
                                     for top in entry.top_logprobs])
            for entry in entries]


def _delta_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": entry.text, "logprob": entry.logprob,
             "top_logprobs": [{"token": top.text, "logprob": top.logprob}
                              for top in entry.top_logprobs]}
            for entry in entries]
