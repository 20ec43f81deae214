"""OpenAI's Responses API (`/v1/responses`) as msgspec Structs (docs/http.md).

As with chat (schema.py), unknown fields are ignored and a known field with a wrong
type fails decoding with its path. Input items and tools are decoded as one loose
shape each (the API's items are told apart by `type`, and a message may omit it), and
responses.py checks what each type needs, naming the field it misses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from sfcore_daemon.core.request import MAX_TOOLS, PositiveInt, TopLogprobs

# The most items one request's input may hold (a long agent conversation sent whole).
MAX_INPUT_ITEMS = 4096
Id = Annotated[str, Meta(max_length=256)]


# --- requests -------------------------------------------------------------------------


class InputPart(Struct, kw_only=True):
    """A part of a message's content: `input_text`, `output_text` (an earlier answer's
    text) or `text` are read; images and files are refused (the model reads text)."""

    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True):
    """One item of `input`: a message (`type` "message" or absent), a function call the
    model made earlier, or a function's output; reasoning items are skipped."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    # function_call
    call_id: Id | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output: text, or text parts
    output: str | list[InputPart] | None = None


class FunctionTool(Struct, kw_only=True):
    """A tool: `function` (the flat Responses shape); any other type is a built-in tool
    (web search, file search, computer use, ...), refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChosenToolIn(Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str = ""
    json_schema: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[InputItem], Meta(max_length=MAX_INPUT_ITEMS)] = ""
    instructions: str | None = None
    previous_response_id: Id | None = None
    store: bool = True
    stream: bool = False
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenToolIn | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    # "auto": the oldest items dropped to fit the context (truncate.py).
    truncation: Literal["auto", "disabled"] | None = None
    prompt_cache_key: Annotated[str, Meta(max_length=1024)] | None = None
    # Accepted and ignored: the model does not reason (docs/http.md).
    reasoning: dict[str, Any] | None = None
    # Refused when set: the daemon keeps no server-side conversations other than
    # previous_response_id's chain. background: run, and polled (background.py).
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    # Beyond OpenAI's fields, as llama-server takes them.
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    # "flex": the background class of the wait queue; any other value: interactive.
    service_tier: Any = None


# --- replies --------------------------------------------------------------------------


class ResponseTopLogprob(Struct, kw_only=True):
    token: str
    bytes: list[int]
    logprob: float


class LogprobOut(Struct, kw_only=True):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[ResponseTopLogprob]


class OutputText(Struct, kw_only=True, omit_defaults=True):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[LogprobOut] | None = None


class OutputMessage(Struct, kw_only=True):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(Struct, kw_only=True):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: str


class ResponseErrorOut(Struct, kw_only=True):
    code: str
    message: str


class TextFormatOut(Struct, kw_only=True, omit_defaults=True):
    type: str
    name: str | None = None
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextConfigOut(Struct, kw_only=True):
    format: TextFormatOut


class FunctionToolOut(Struct, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class ResponseObject(Struct, kw_only=True):
    """The `response` object: the whole reply, GET's answer, and the streamed
    lifecycle events' payload (with the output so far)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    completed_at: int | None
    error: ResponseErrorOut | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    text: TextConfigOut
    tool_choice: str | dict[str, str]
    tools: list[FunctionToolOut]
    top_logprobs: int | None
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    metadata: dict[str, str]
    background: bool = False


class DeletedResponse(Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


responses_decoder = msgspec.json.Decoder(ResponsesRequest)
