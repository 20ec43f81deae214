"""What maps to what in the Responses API: a `/v1/responses` body to the daemon's own
chat request, as translate.py does for chat completions.

`instructions` becomes the first system message; the input items (after those of the
conversation `previous_response_id` names, which store.py keeps) become the
messages: `message` items by role, a run of `function_call` items one assistant message
with calls, each `function_call_output` a tool message. A value the daemon cannot
honour is an `ApiError` naming the field (`input[3].call_id`), never dropped quietly.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, NamedTuple

import msgspec

from sfcore_daemon.core.request import (
    MAX_STOPS,
    ChatRequest,
    ChosenFunction,
    ChosenTool,
    FunctionCall,
    FunctionSpec,
    Message,
    Tool,
    ToolCall,
)
from sfcore_daemon.httpd.api import tier_priority
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.responses.schema import (
    ChosenToolIn,
    FunctionTool,
    InputItem,
    InputPart,
    ResponsesRequest,
)

LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_TEXT_PARTS: Final = frozenset({"input_text", "output_text", "text"})
# Items a client may send back that carry nothing the model reads here.
_SKIPPED_ITEMS: Final = frozenset({"reasoning"})
_ROLES: Final = {"user": "user", "assistant": "assistant", "system": "system",
                 "developer": "system"}


class Mapped(NamedTuple):
    request: ChatRequest
    # The conversation without the instructions: what a response to this request is
    # stored with, so that the next turn names it instead of sending it again.
    conversation: list[Message]


def unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "unsupported")


def responses_request(body: ResponsesRequest, request_id: str,
                      history: list[Message]) -> Mapped:
    """The daemon's chat request for `body`, after the earlier turns `history`."""
    if body.conversation is not None:
        raise unsupported("conversation objects are not kept here: chain turns with "
                          "previous_response_id", "conversation")
    if body.background and body.stream:
        raise unsupported("background responses are polled here (GET), not streamed",
                          "stream")
    if body.background and not body.store:
        raise ApiError(400, "a background response must be stored (store: true) to be "
                       "polled", "store")
    conversation = list(history)
    if isinstance(body.input, str):
        if body.input:
            conversation.append(Message(role="user", content=body.input))
    else:
        for index, item in enumerate(body.input):
            _add_item(conversation, item, f"input[{index}]")
    if not conversation:
        raise ApiError(400, "input must hold at least one message", "input")
    messages = conversation
    if body.instructions:
        messages = [Message(role="system", content=body.instructions), *conversation]
    logprobs = None
    if body.include and LOGPROBS_INCLUDE in body.include:
        logprobs = body.top_logprobs or 0
    request = ChatRequest(id=request_id, messages=messages, stream=body.stream,
                          max_tokens=body.max_output_tokens, logprobs=logprobs,
                          **_tool_options(body), **_sampling(body),
                          prompt_cache_key=body.prompt_cache_key)
    return Mapped(request, conversation)


def _add_item(conversation: list[Message], item: InputItem, where: str) -> None:
    kind = item.type or ("message" if item.role is not None else None)
    if kind == "message":
        conversation.append(_message(item, where))
    elif kind == "function_call":
        call = ToolCall(id=_call_id(item, where), function=FunctionCall(
            name=_name(item.name, f"{where}.name"),
            arguments=_arguments(item.arguments, f"{where}.arguments")))
        last = conversation[-1] if conversation else None
        # The calls of one answer follow its text (if any): one assistant message.
        if last is not None and last.role == "assistant":
            # Replaced, not changed: a stored conversation shares its messages.
            conversation[-1] = msgspec.structs.replace(
                last, tool_calls=[*(last.tool_calls or ()), call])
        else:
            conversation.append(Message(role="assistant", content="", tool_calls=[call]))
    elif kind == "function_call_output":
        if item.output is None:
            raise ApiError(400, "a function_call_output item needs its output", f"{where}.output")
        conversation.append(Message(role="tool", tool_call_id=_call_id(item, where),
                                    content=_text(item.output, f"{where}.output")))
    elif kind in _SKIPPED_ITEMS:
        return
    elif kind is None:
        raise ApiError(400, "an input item needs a type (or a role, for a message)",
                       f"{where}.type")
    else:
        raise unsupported(f"input items of type {kind!r} are not supported: send message, "
                          "function_call and function_call_output items", f"{where}.type")


def _message(item: InputItem, where: str) -> Message:
    role = _ROLES.get(item.role or "")
    if role is None:
        raise ApiError(400, f"role {item.role!r} is not one of user, assistant, system, "
                       "developer", f"{where}.role")
    if item.content is None:
        raise ApiError(400, "a message item needs its content", f"{where}.content")
    return Message(role=role, content=_text(item.content, f"{where}.content"))  # type: ignore[arg-type]


def _text(content: str | list[InputPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for number, part in enumerate(content):
        if part.type not in _TEXT_PARTS:
            raise unsupported(f"content parts of type {part.type!r} are not supported: the "
                              "model reads text only", f"{where}[{number}].type")
        if part.text is None:
            raise ApiError(400, f"a {part.type} part needs its text", f"{where}[{number}].text")
        texts.append(part.text)
    return "\n".join(texts)


def _call_id(item: InputItem, where: str) -> str:
    if not item.call_id:
        raise ApiError(400, f"a {item.type} item needs its call_id", f"{where}.call_id")
    return item.call_id


def _name(name: str | None, where: str) -> str:
    if name is None or not _NAME.fullmatch(name):
        raise ApiError(400, "a function's name is 1 to 64 letters, digits, _ . or -", where)
    return name


def _arguments(text: str | None, where: str) -> dict[str, Any]:
    """An earlier call's arguments, sent as JSON text: an object."""
    try:
        value = json.loads(text) if text and text.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(400, "a call's arguments must be a JSON object (as text)", where)
    return value


def _tool_options(body: ResponsesRequest) -> dict[str, Any]:
    choice = body.tool_choice
    if isinstance(choice, ChosenToolIn) and choice.type != "function":
        raise unsupported(f"tool_choice of type {choice.type!r} is not supported: only "
                          "function tools run here", "tool_choice.type")
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return {}
    tools = [_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools)]
    chosen: Any = choice
    if isinstance(choice, ChosenToolIn):
        chosen = ChosenTool(type="function", function=ChosenFunction(
            name=_name(choice.name, "tool_choice.name")))
    return {"tools": tools, "tool_choice": chosen,
            "parallel_tool_calls": body.parallel_tool_calls is not False}


def _tool(tool: FunctionTool, where: str) -> Tool:
    if tool.type != "function":
        raise unsupported(f"the built-in tool {tool.type!r} is not supported: only function "
                          "tools run here (the daemon reaches nothing outside)", f"{where}.type")
    return Tool(type="function", function=FunctionSpec(
        name=_name(tool.name, f"{where}.name"), description=tool.description or "",
        parameters=tool.parameters, strict=tool.strict))


def _sampling(body: ResponsesRequest) -> dict[str, Any]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    stops = [stop for stop in stops if stop]
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    options: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "repeat_penalty": body.repeat_penalty,
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        # The sampler folds any integer into its 32-bit seed range.
        "seed": body.seed % (1 << 63) if body.seed is not None else None,
        "stop": stops or None,
        "priority": tier_priority(body.service_tier),
    }
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        options["format"] = "json"
    elif text_format is not None and text_format.type == "json_schema":
        schema = text_format.json_schema
        if schema is None or schema is False:
            raise ApiError(400, "text.format json_schema needs its schema (an object)",
                           "text.format.schema")
        options["json_schema"] = {} if schema is True else schema
    return options
