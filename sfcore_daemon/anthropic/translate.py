"""What maps to what: a Messages body to the daemon's `ChatRequest`, `done` back to a
Messages reply.

The body becomes the chat an NDJSON client could have sent: `system` the first
message, a user turn's `tool_result` blocks tool messages, an assistant turn's
`tool_use` blocks its calls, `tools` the daemon's functions (so a call is held to its
`input_schema` by the same grammar as Chat Completions' calls). What the daemon cannot
honour is an `ApiError` naming the field (written in Anthropic's shape by errors.py),
never silently dropped; thinking blocks, which a model that does not reason never
wrote, are the one thing left out.

`cache_control` marks become the chat's `cache_marks`: a mark on a message's block
marks the daemon message that holds the block's text (a user turn's text blocks are
one message), on a system block the system message, on a tool the prompt before the
first message's text (docs/messages.md, Prompt caching).
"""

from __future__ import annotations

import secrets
from typing import Any, Final, Literal

from sfcore_daemon.anthropic.schema import (
    CacheControlIn,
    ContentBlock,
    ContentBlockIn,
    CountTokensRequest,
    MessageIn,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextBlock,
    TextBlockIn,
    ToolIn,
    ToolUseBlock,
)
from sfcore_daemon.core.request import (
    MAX_CACHE_MARKS,
    MAX_STOPS,
    CacheMark,
    ChatRequest,
    ChosenFunction,
    ChosenTool,
    FunctionCall,
    FunctionSpec,
    Message,
    Tool,
    ToolCall,
)
from sfcore_daemon.core.result import Result
from sfcore_daemon.httpd.errors import ApiError

# Blocks an assistant's earlier turn may hold that say nothing the prompt needs.
_DROPPED_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})
_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
# The daemon's chat fields in its error messages -> the Messages fields they came from.
_FIELD_NAMES: Final = ((".function.parameters", ".input_schema"), (".function.name", ".name"),
                       ("$.json_schema", "$.output_config.format.schema"))
_TTL_S: Final = {"5m": 300, "1h": 3600}
# A mark on the prompt before the first message (CacheMark.message).
_BEFORE_MESSAGES: Final = -1


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def chat_request(body: CountTokensRequest, request_id: str) -> ChatRequest:
    """The daemon's chat for `body` (a MessagesRequest, or count_tokens' body, which
    has no generation fields)."""
    if not body.messages:
        raise ApiError(400, "at least one message is needed", "messages")
    messages = [*_system(body.system)]
    marks = _system_marks(body, bool(messages))
    for index, message in enumerate(body.messages):
        turn, marked = _turn(index, message)
        marks += [CacheMark(message=len(messages) + at, ttl_s=ttl) for at, ttl in marked]
        messages.extend(turn)
    if len(marks) > MAX_CACHE_MARKS:
        raise ApiError(400, f"A maximum of {MAX_CACHE_MARKS} blocks with cache_control may "
                       f"be provided. Found {len(marks)}.", "cache_control")
    options: dict[str, Any] = {**_tool_options(body)}
    if marks:
        options["cache_marks"] = marks
    if body.output_config is not None and body.output_config.format is not None:
        options["json_schema"] = body.output_config.format.json_schema
    if isinstance(body, MessagesRequest):
        options.update(_generation(body))
    return ChatRequest(id=request_id, messages=messages, **options)


def _ttl(control: CacheControlIn | None) -> int:
    return 0 if control is None else _TTL_S[control.ttl]


def _system_marks(body: CountTokensRequest, has_system: bool) -> list[CacheMark]:
    """The marks on tools and system blocks (tools come before the system prompt in
    Anthropic's prefix order; the daemon's templates write both in the first turn)."""
    marks = [CacheMark(message=_BEFORE_MESSAGES, ttl_s=_ttl(tool.cache_control))
             for tool in body.tools or () if tool.cache_control is not None]
    if isinstance(body.system, list):
        at = 0 if has_system else _BEFORE_MESSAGES
        marks += [CacheMark(message=at, ttl_s=_ttl(block.cache_control))
                  for block in body.system if block.cache_control is not None]
    return marks


def _system(system: str | list[TextBlockIn] | None) -> list[Message]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _texts(system, "system")
    return [Message(role="system", content=text)] if text else []


def _texts(blocks: list[TextBlockIn], where: str) -> str:
    texts = []
    for number, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise ApiError(400, f"blocks of type {block.type!r} are not "
                           "supported here: the model reads text only",
                           f"{where}[{number}].type")
        texts.append(block.text)
    return "\n".join(texts)


def _turn(index: int, message: MessageIn) -> tuple[list[Message], list[tuple[int, int]]]:
    """One Messages turn as the daemon's messages: a user turn may become several (its
    tool results, then its text), in the order of its blocks; and its blocks' cache
    marks, as (the index among those messages of the one that holds the block, TTL)."""
    where = f"messages[{index}]"
    if message.role not in ("user", "assistant"):
        raise ApiError(400, f"{message.role!r} is not user or assistant (the system "
                       "prompt is the top-level `system` field)", f"{where}.role")
    role: Literal["user", "assistant"] = "user" if message.role == "user" else "assistant"
    if isinstance(message.content, str):
        return [Message(role=role, content=message.content)], []
    out: list[Message] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    marks: list[tuple[int, int]] = []
    pending: list[int] = []  # the TTLs of marked blocks in `texts` (or a dropped block)
    for number, block in enumerate(message.content):
        at = f"{where}.content[{number}]"
        kind = block.type
        if kind == "text" and block.text is not None:
            texts.append(block.text)
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, at))
        elif kind == "tool_result" and role == "user":
            if texts:
                out.append(Message(role="user", content="\n".join(texts)))
                texts = []
                marks += [(len(out) - 1, ttl) for ttl in pending]
                pending = []
            out.append(_result(block, at))
            if _result_marked(block):
                marks.append((len(out) - 1, _ttl(block.cache_control) or _result_ttl(block)))
                continue
        elif kind not in _DROPPED_BLOCKS:
            raise ApiError(400, f"a {role} turn's blocks of type {kind!r} are "
                           "not supported (text" + (", tool_use" if role == "assistant"
                                                    else ", tool_result")
                           + " and thinking are)", f"{at}.type")
        if block.cache_control is not None:
            pending.append(_ttl(block.cache_control))
    if texts or calls or not out:
        out.append(Message(role=role, content="\n".join(texts), tool_calls=calls or None))
    marks += [(len(out) - 1, ttl) for ttl in pending]
    return out, marks


def _result_marked(block: ContentBlockIn) -> bool:
    """A tool_result marked itself or on a block of its content."""
    content = block.content
    return block.cache_control is not None or (isinstance(content, list) and any(
        part.cache_control is not None for part in content))


def _result_ttl(block: ContentBlockIn) -> int:
    content = block.content
    assert isinstance(content, list)
    return max(_ttl(part.cache_control) for part in content)


def _call(block: ContentBlockIn, at: str) -> ToolCall:
    if block.id is None or block.name is None:
        raise ApiError(400, "a tool_use block needs id and name",
                       f"{at}.id" if block.id is None else f"{at}.name")
    return ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                       arguments=block.input or {}))


def _result(block: ContentBlockIn, at: str) -> Message:
    if block.tool_use_id is None:
        raise ApiError(400, "a tool_result block needs tool_use_id",
                       f"{at}.tool_use_id")
    content = block.content
    text = _texts(content, f"{at}.content") if isinstance(content, list) else content or ""
    if block.is_error:
        text = f"Error: {text}"
    return Message(role="tool", content=text, tool_call_id=block.tool_use_id)


def _tool_options(body: CountTokensRequest) -> dict[str, Any]:
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise ApiError(400, f"tool_choice {choice.type!r} needs tools", "tool_choice.type")
        return {}
    tools = [_tool(index, tool) for index, tool in enumerate(body.tools)]
    options: dict[str, Any] = {"tools": tools}
    if choice is None:
        return options
    if choice.type == "tool":
        if choice.name is None:
            raise ApiError(400, "tool_choice \"tool\" needs the tool's name",
                           "tool_choice.name")
        if all(tool.name != choice.name for tool in body.tools):
            raise ApiError(400, f"tool_choice names {choice.name!r}, which is not among the "
                           "tools", "tool_choice.name")
        options["tool_choice"] = ChosenTool(type="function",
                                            function=ChosenFunction(name=choice.name))
    else:
        options["tool_choice"] = _CHOICES[choice.type]
    options["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return options


def _tool(index: int, tool: ToolIn) -> Tool:
    if tool.type not in (None, "custom"):
        raise ApiError(400, f"the tool {tool.name!r} (type {tool.type!r}) is "
                       "one of Anthropic's server or built-in tools, which this daemon does "
                       "not run: offer it as a client tool with an input_schema",
                       f"tools[{index}].type")
    return Tool(type="function", function=FunctionSpec(
        name=tool.name, description=tool.description, parameters=tool.input_schema))


def _generation(body: MessagesRequest) -> dict[str, Any]:
    stops = [stop for stop in body.stop_sequences or () if stop]
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop_sequences holds {len(stops)} strings; at most {MAX_STOPS}",
                       "stop_sequences")
    options: dict[str, Any] = {
        "stream": body.stream, "max_tokens": body.max_tokens, "stop": stops or None,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    if body.top_p == 0:
        # Anthropic's range takes 0, the daemon's does not: the sampler keeps at least
        # the likeliest token, which is what top_k 1 says.
        options.update(top_p=None, top_k=1)
    return options


def in_messages_terms(error: ApiError) -> ApiError:
    """An error of the daemon's chat (a tool's schema, a duplicate name, the output
    schema) with its fields as the Messages body names them."""
    for chat_name, messages_name in _FIELD_NAMES:
        error.message = error.message.replace(chat_name, messages_name)
    if error.param is not None:
        # The OpenAI side names the output schema's errors after its response_format.
        param = "$." + error.param.replace("response_format", "json_schema")
        for chat_name, messages_name in _FIELD_NAMES:
            param = param.replace(chat_name, messages_name)
        error.param = param.removeprefix("$.")
    return error


# --- replies --------------------------------------------------------------------------


def stop_reason(done: Result) -> StopReason:
    """Anthropic's stop_reason. A JSON document closed early to fit max_tokens, and a
    generation cut by a stopping daemon, ended before their natural end: max_tokens."""
    if done.tool_calls:
        return "tool_use"
    if done.stop_sequence is not None:
        return "stop_sequence"
    if done.truncated or done.finish_reason in ("length", "cancelled"):
        return "max_tokens"
    return "end_turn"


def usage(done: Result) -> MessageUsage:
    """Anthropic's usage: the prompt split into what was read from the cache (the
    tokens whose state was reused), what was written to it (the tokens after those up
    to the last cache mark whose state this request stored) and the rest."""
    counts = done.usage
    read, written = counts.cached_tokens, counts.cache_write_tokens
    return MessageUsage(input_tokens=counts.prompt_tokens - read - written,
                        output_tokens=counts.completion_tokens,
                        cache_creation_input_tokens=written, cache_read_input_tokens=read)


def tool_uses(done: Result) -> list[ToolUseBlock]:
    return [ToolUseBlock(id="toolu_" + call.id.removeprefix("call_"), name=call.function.name,
                         input=call.function.arguments)
            for call in done.tool_calls or ()]


def content(done: Result) -> list[ContentBlock]:
    """The reply's blocks: its text (when it has any, or is nothing else), then its calls."""
    blocks: list[ContentBlock] = [*tool_uses(done)]
    if done.text or not blocks:
        blocks.insert(0, TextBlock(text=done.text))
    return blocks
