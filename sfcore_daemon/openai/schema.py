"""OpenAI's request and response bodies as msgspec Structs (docs/openai.md).

Requests keep OpenAI's field names and ranges. Fields the daemon does not know are
ignored, as OpenAI-compatible servers do (no `forbid_unknown_fields`); a known field
with a wrong value fails decoding with the field's path, which becomes the error's
`param`. Replies are encoded by one reused Encoder.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from sfcore_daemon.core.request import CacheKey, PositiveInt, ToolName, TopLogprobs

Penalty = Annotated[float, Meta(ge=-2, le=2)]


# --- requests -------------------------------------------------------------------------


class ContentPart(Struct, kw_only=True):
    """One part of a message's content; only text parts are understood."""

    type: str
    text: str | None = None


class FunctionCallIn(Struct, kw_only=True):
    name: ToolName
    # OpenAI sends a call's arguments as a JSON text.
    arguments: str


class ToolCallIn(Struct, kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=64)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


class FunctionIn(Struct, kw_only=True):
    name: ToolName
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionIn


class ChosenFunctionIn(Struct, kw_only=True):
    name: ToolName


class ChosenToolIn(Struct, kw_only=True):
    type: Literal["function"]
    function: ChosenFunctionIn


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(Struct, kw_only=True):
    name: str = ""
    # `schema` is a Struct attribute name in msgspec's eyes only as a field: renamed.
    json_schema: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(Struct, kw_only=True):
    """What chat and completions requests share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # Beyond OpenAI's fields, as llama-server takes them: the daemon's own sampling knobs.
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    # "flex" asks for the background class of the wait queue; any other value (what
    # was taken before it meant anything here) for the interactive one.
    service_tier: Any = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=64)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenToolIn | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    # A hint: requests with the same key prefer the slot the key last ran in.
    prompt_cache_key: CacheKey | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, or a list of one (OpenAI's batches and token arrays are refused: one
    # request is one generation here).
    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# --- replies --------------------------------------------------------------------------


class ModelCard(Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "sfcore-ai"
    # Beyond OpenAI's card: the context in force, in tokens, and its KV cache's bytes.
    context_length: int = 0
    kv_bytes: int = 0


class ModelList(Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class CompletionUsage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobOut(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(Struct, kw_only=True):
    content: list[TokenLogprobOut]
    refusal: None = None


class FunctionCallOut(Struct, kw_only=True):
    name: str
    arguments: str


class ToolCallOut(Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCallOut


class ToolCallDelta(Struct, kw_only=True):
    index: int
    id: str
    type: str = "function"
    function: FunctionCallOut


# omit_defaults: `tool_calls` only in an answer that made calls.
class AssistantMessage(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class Delta(Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


# omit_defaults: `usage` only when the client asked (stream_options.include_usage), as
# OpenAI does; `object` has no default, so it is always written.
class ChatCompletionChunk(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None = None


class LegacyLogprobs(Struct, kw_only=True):
    """The completions API's logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct, kw_only=True):
    text: str
    index: int = 0
    logprobs: LegacyLogprobs | None
    finish_reason: str | None


class Completion(Struct, kw_only=True, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)

