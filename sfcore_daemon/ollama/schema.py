"""Ollama's bodies as msgspec Structs (docs/ollama.md).

Requests keep Ollama's field names. Fields the daemon has no use for (`keep_alive`,
`think`, `context`, a message's `thinking`, most `options`) are accepted and ignored,
as Ollama ignores options a model does not take; a known field with a wrong type or
value fails decoding with its path in the message (a 400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from sfcore_daemon.core.request import MAX_TOOLS, ToolName, TopLogprobs

# --- requests -------------------------------------------------------------------------


class Options(Struct, kw_only=True):
    """The options the sampler takes; any other key (num_ctx, num_thread, mirostat,
    typical_p, ...) is ignored. Ranges are the core's where Ollama has no wider meaning."""

    # <= 0: Ollama's "until the context is full" (-1, -2): the daemon's max_tokens.
    num_predict: int | None = None
    temperature: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    # < 0: no top-k (llama.cpp's meaning).
    top_k: int | None = None
    # 0: only the likeliest token, sent as top_k 1 (the core's range starts above 0).
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    # < 0: Ollama's "random" (-1).
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None


# `format`: "json", "" (none), or a JSON Schema object.
Format = str | dict[str, Any] | None
# `keep_alive`: a duration ("5m"), seconds, or -1 / 0; accepted and ignored.
KeepAlive = str | float | None


class Common(Struct, kw_only=True):
    """What /api/chat and /api/generate share."""

    model: str
    # Ollama streams unless told not to.
    stream: bool = True
    format: Format = None
    options: Options | None = None
    keep_alive: KeepAlive = None
    # A reasoning model's switch (true, false, "low", ...); this model does not reason.
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


class FunctionCallIn(Struct, kw_only=True):
    name: ToolName
    # An object; JSON text of one is taken too.
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class ToolCallIn(Struct, kw_only=True):
    function: FunctionCallIn
    id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class MessageIn(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=64)] | None = None
    # A tool message: the function whose result it is.
    tool_name: str | None = None


class FunctionIn(Struct, kw_only=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolIn(Struct, kw_only=True):
    type: str = "function"
    function: FunctionIn


class ChatBody(Common, kw_only=True):
    # Empty: load the model (Ollama's way to warm it), nothing generated.
    messages: list[MessageIn] = msgspec.field(default_factory=list)
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None


class GenerateBody(Common, kw_only=True):
    # Empty: load the model, nothing generated.
    prompt: str = ""
    system: str | None = None
    # true: the prompt as it is, no chat template.
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    images: list[Any] | None = None
    # The deprecated token context of an earlier reply; ignored.
    context: list[Any] | None = None


class ShowBody(Struct, kw_only=True):
    # Older clients send `name`.
    model: str | None = None
    name: str | None = None
    verbose: bool = False


# --- replies --------------------------------------------------------------------------


class FunctionCallOut(Struct, kw_only=True):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(Struct, kw_only=True):
    function: FunctionCallOut


class MessageOut(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"]
    content: str
    tool_calls: list[ToolCallOut] | None = None


class TopLogprobOut(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class LogprobOut(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class Line(Struct, kw_only=True, omit_defaults=True):
    """One NDJSON line of a reply (or its whole body); the counts on the last only."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None
    logprobs: list[LogprobOut] | None = None


class ChatLine(Line, kw_only=True, omit_defaults=True):
    message: MessageOut


class GenerateLine(Line, kw_only=True, omit_defaults=True):
    response: str


class ErrorBody(Struct, kw_only=True):
    error: str


class Details(Struct, kw_only=True):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ModelEntry(Struct, kw_only=True, omit_defaults=True):
    """A model of /api/tags, or (with the fields after `details`) of /api/ps."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: Details
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class ModelList(Struct, kw_only=True):
    models: list[ModelEntry]


class ShowReply(Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: Details
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class Version(Struct, kw_only=True):
    version: str


chat_decoder = msgspec.json.Decoder(ChatBody)
generate_decoder = msgspec.json.Decoder(GenerateBody)
show_decoder = msgspec.json.Decoder(ShowBody)
