"""Anthropic's Messages bodies as msgspec Structs (docs/messages.md).

Requests keep Anthropic's field names and ranges; fields the daemon does not know
(`metadata`, `thinking`, `service_tier`, ...) are ignored, as its other HTTP routes
ignore theirs; `cache_control` on a block or a tool is read (translate.py). A known
field with a wrong type or value fails decoding with the field's path in the message.
Content blocks are one loose Struct whose `type` translate.py checks, so an unsupported
block is refused by name rather than as a decoding error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from sfcore_daemon.core.request import MAX_TOOLS, ToolName

Id = Annotated[str, Meta(min_length=1, max_length=256)]


# --- requests -------------------------------------------------------------------------


class CacheControlIn(Struct, kw_only=True):
    """A cache mark: the prompt up to this block is kept for `ttl` from its last use."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlockIn(Struct, kw_only=True):
    """A block of `system` or of a tool result's content; only text is understood."""

    type: str
    text: str | None = None
    cache_control: CacheControlIn | None = None


class ContentBlockIn(Struct, kw_only=True):
    """Any block of a message's content: text, tool_use (assistant), tool_result (user);
    thinking blocks are dropped, anything else is refused by its type."""

    type: str
    text: str | None = None
    # tool_use
    id: Id | None = None
    name: ToolName | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: Id | None = None
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None
    cache_control: CacheControlIn | None = None


class MessageIn(Struct, kw_only=True):
    role: str
    content: str | list[ContentBlockIn]


class ToolIn(Struct, kw_only=True):
    name: ToolName
    description: str = ""
    input_schema: dict[str, Any] | None = None
    # None or "custom": a client tool; any other type is one of Anthropic's server or
    # client-defined tools (web_search_..., bash_..., text_editor_...), refused.
    type: str | None = None
    cache_control: CacheControlIn | None = None


class ToolChoiceIn(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormatIn(Struct, kw_only=True):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = msgspec.field(name="schema")


class OutputConfigIn(Struct, kw_only=True):
    # `effort` is a reasoning model's: ignored.
    format: OutputFormatIn | None = None


class CountTokensRequest(Struct, kw_only=True):
    """`/v1/messages/count_tokens`: what the prompt is made of."""

    model: str | None = None
    messages: list[MessageIn]
    system: str | list[TextBlockIn] | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceIn | None = None
    output_config: OutputConfigIn | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """`/v1/messages`: the prompt, and how to generate. `max_tokens` is required, as
    Anthropic's is (its 0, "only warm the prompt cache", is not taken)."""

    max_tokens: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None


# --- replies --------------------------------------------------------------------------


class TextBlock(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(Struct, kw_only=True):
    # Anthropic's split of the prompt: input_tokens are those neither read from the
    # cache nor written to it; the three add up to count_tokens' input_tokens.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokensCount(Struct, kw_only=True):
    input_tokens: int


class ErrorObject(Struct, kw_only=True):
    type: str
    message: str


class MessagesError(Struct, kw_only=True, tag="error", tag_field="type"):
    error: ErrorObject


# --- stream events (each `event: <type>` with its JSON as `data:`) --------------------


class MessageStart(Struct, kw_only=True, tag="message_start", tag_field="type"):
    message: MessageOut


class Ping(Struct, kw_only=True, tag="ping", tag_field="type"):
    pass


class BlockStart(Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(Struct, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class BlockDelta(Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta


class BlockStop(Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(Struct, kw_only=True):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(Struct, kw_only=True, tag="message_delta", tag_field="type"):
    delta: StopDelta
    # Totals, as Anthropic's are (its SDK overwrites message_start's with them).
    usage: MessageUsage


class MessageStop(Struct, kw_only=True, tag="message_stop", tag_field="type"):
    pass


messages_decoder = msgspec.json.Decoder(MessagesRequest)
count_tokens_decoder = msgspec.json.Decoder(CountTokensRequest)
encoder = msgspec.json.Encoder()
