"""The request the core is given: a completion or a chat, and the options they share.

Every front end translates its wire format into these (the NDJSON ops extend them with
their tag). They are frozen: what a request asks is fixed once it is admitted.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from msgspec import Meta, Struct

RequestId = str | int

StopText = Annotated[str, Meta(min_length=1)]
# Bounds past the protocol's "int >= 0" / "float >= 0" keep values that llama.cpp
# takes as C ints finite and unwrapped; they are far beyond any useful setting.
CInt = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# The most alternatives a token's logprobs may list (OpenAI's top_logprobs limit).
MAX_LOGPROBS: Final = 20
# The most stop strings one request may give (OpenAI allows 4).
MAX_STOPS: Final = 8
PositiveInt = Annotated[int, Meta(ge=1, le=2**31 - 1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# Which class of the wait queue a request waits in (scheduler.py): interactive ones
# start first; a background one is passed only a bounded number of times.
Priority = Literal["interactive", "background"]
PRIORITIES: Final[tuple[Priority, ...]] = ("interactive", "background")


class GenerationOptions(Struct, frozen=True, kw_only=True):
    """What every generation takes, whichever way its prompt is given."""

    id: RequestId | None = None
    stream: bool = True
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    top_k: CInt | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    # OpenAI's: subtracted from a recent token's logit per use, and once if used at all.
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    seed: Annotated[int, Meta(ge=0)] | None = None
    stop: StopText | Annotated[list[StopText], Meta(max_length=MAX_STOPS)] | None = None
    cache_prompt: bool = True
    # Structured output, at most one of them (see grammar.py): a JSON Schema the output
    # must be valid against, any JSON object, or a GBNF grammar.
    json_schema: dict[str, Any] | None = None
    format: Literal["json"] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None
    # false: never draft tokens for this request (see speculative.py); the output is
    # the same either way, only its speed differs.
    speculative: bool = True
    # Each token's log-probability and its `logprobs` likeliest alternatives (0: the
    # token's own only); None: none. OpenAI's top_logprobs has the same range.
    logprobs: TopLogprobs | None = None
    priority: Priority = "interactive"

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(dict.fromkeys(self.stop))


class GenerateRequest(GenerationOptions, frozen=True, kw_only=True):
    """A completion of a raw prompt."""

    prompt: Annotated[str, Meta(min_length=1)]


# A function's name as OpenAI allows it (it is also what a call must name exactly).
# msgspec matches with re.search: `\Z`, since `$` also matches before a final newline.
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")]
# Tools one request may offer; each is a JSON Schema compiled into the call's grammar.
MAX_TOOLS: Final = 64


class FunctionCall(Struct, forbid_unknown_fields=True, kw_only=True):
    """A call of a function: its name and its arguments (a JSON object)."""

    name: ToolName
    arguments: dict[str, Any]


class ToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    # An assistant's earlier calls (docs/protocol.md, Tool calls).
    tool_calls: Annotated[list[ToolCall], Meta(max_length=64)] | None = None
    # A tool message: the call it answers.
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


class FunctionSpec(Struct, forbid_unknown_fields=True, kw_only=True):
    name: ToolName
    description: str = ""
    # JSON Schema of the arguments object; None: any object.
    parameters: dict[str, Any] | None = None
    # OpenAI's flag; the arguments always validate here, so it changes nothing.
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(Struct, forbid_unknown_fields=True, kw_only=True):
    name: ToolName


class ChosenTool(Struct, forbid_unknown_fields=True, kw_only=True):
    """`tool_choice` naming one function: the answer is one call of it."""

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | ChosenTool

# Anthropic's longest cache TTL, and its most cache_control marks in one request.
MAX_CACHE_TTL_S: Final = 3600
MAX_CACHE_MARKS: Final = 4
CacheKey = Annotated[str, Meta(max_length=1024)]


class CacheMark(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A prefix to pin in the prompt store (docs/messages.md, Prompt caching): the prompt
    up to the end of message `message`'s text, or of the system turn (and the tool
    definitions a template writes there) when that message is the system prompt; -1:
    the prompt before the first message's text. Kept `ttl_s` seconds from its last use."""

    message: Annotated[int, Meta(ge=-1, le=2**31 - 1)]
    ttl_s: Annotated[int, Meta(ge=1, le=MAX_CACHE_TTL_S)] = 300


class ChatRequest(GenerationOptions, frozen=True, kw_only=True):
    """A chat: messages rendered by the model's template, maybe with tools."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    # None: "auto" when tools are given.
    tool_choice: ToolChoice | None = None
    # false: one call at most per answer.
    parallel_tool_calls: bool = True
    cache_marks: Annotated[list[CacheMark], Meta(max_length=MAX_CACHE_MARKS)] | None = None
    # OpenAI's hint: requests with the same key prefer the slot the key last used.
    prompt_cache_key: CacheKey | None = None


GenerationRequest = GenerateRequest | ChatRequest
