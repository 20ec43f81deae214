"""What maps to what: Ollama's chat and generate bodies to the core's requests.

A chat becomes the core's `ChatRequest`; a generate becomes a chat of its `system`
and `prompt` (Ollama renders them with the model's template), or with `raw` the core's
`GenerateRequest` of the prompt as it is. What the daemon cannot honour (images,
`suffix`, a Go `template`) is an `ApiError` naming the field, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Final

from sfcore_daemon.core.request import (
    MAX_STOPS,
    ChatRequest,
    FunctionCall,
    FunctionSpec,
    GenerateRequest,
    GenerationRequest,
    Message,
    Tool,
    ToolCall,
)
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.ollama.schema import (
    ChatBody,
    Common,
    GenerateBody,
    MessageIn,
    Options,
    ToolIn,
)

_MAX_C_INT: Final = 2**31 - 1


def chat_request(body: ChatBody, request_id: str) -> ChatRequest:
    _check_model(body)
    if not body.messages:
        raise ApiError(400, "messages must hold at least one message", "messages")
    messages: list[Message] = []
    # The calls of the last assistant message not yet answered: (id, name).
    pending: list[tuple[str, str]] = []
    for index, message in enumerate(body.messages):
        messages.append(_message(index, message, pending))
    tools = [Tool(type="function", function=FunctionSpec(
        name=tool.function.name, description=tool.function.description or "",
        parameters=tool.function.parameters)) for tool in _tools(body)]
    return ChatRequest(id=request_id, messages=messages, tools=tools or None,
                       **_options(body))


def generate_request(body: GenerateBody, request_id: str) -> GenerationRequest:
    _check_model(body)
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
    if body.template:
        raise ApiError(400, "template is not supported: the model's own chat template "
                       "renders the prompt (or send raw: true with a prompt you formatted)",
                       "template")
    _no_images(body.images, "images")
    if not body.prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if body.raw:
        if body.system:
            raise ApiError(400, "system needs the chat template, which raw: true skips: "
                           "write it into the prompt", "system")
        return GenerateRequest(id=request_id, prompt=body.prompt, **_options(body))
    messages = [Message(role="user", content=body.prompt)]
    if body.system:
        messages.insert(0, Message(role="system", content=body.system))
    return ChatRequest(id=request_id, messages=messages, **_options(body))


def _check_model(body: Common) -> None:
    # Any name is the served model (docs/ollama.md, Model names); an empty one is refused.
    if not body.model:
        raise ApiError(400, "model is required", "model")


def _no_images(images: list[Any] | None, where: str) -> None:
    if images:
        raise ApiError(400, "images are not supported: the model reads text only", where)


def _message(index: int, message: MessageIn, pending: list[tuple[str, str]]) -> Message:
    where = f"messages[{index}]"
    _no_images(message.images, f"{where}.images")
    content = message.content or ""
    if message.role == "assistant":
        calls = [ToolCall(id=call.id or f"call_{index}_{number}", function=FunctionCall(
            name=call.function.name,
            arguments=_arguments(call.function.arguments,
                                 f"{where}.tool_calls[{number}].function.arguments")))
                 for number, call in enumerate(message.tool_calls or ())]
        pending[:] = [(call.id, call.function.name) for call in calls]
        return Message(role="assistant", content=content, tool_calls=calls or None)
    if message.tool_calls:
        raise ApiError(400, "only an assistant message carries tool_calls",
                       f"{where}.tool_calls")
    if message.role != "tool":
        return Message(role=message.role, content=content)
    # A result answers the first unanswered call of its function (Ollama's tool_name),
    # else the first unanswered call.
    answered = next((call for call in pending if call[1] == message.tool_name),
                    pending[0] if pending else None)
    if answered is not None:
        pending.remove(answered)
    return Message(role="tool", content=content,
                   tool_call_id=answered[0] if answered is not None else None)


def _arguments(value: dict[str, Any] | str, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value) if value.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ApiError(400, "a call's arguments must be a JSON object", where)
    return parsed


def _tools(body: ChatBody) -> list[ToolIn]:
    """The tools, each a function (two of one name are refused by the core's chat)."""
    for index, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise ApiError(400, f"tools of type {tool.type!r} are not supported (function "
                           "is)", f"tools[{index}].type")
    return list(body.tools or ())


def _options(body: Common) -> dict[str, Any]:
    """The generation fields both requests share, in the core's terms."""
    options = body.options or Options()
    stops = [options.stop] if isinstance(options.stop, str) else list(options.stop or ())
    stops = [stop for stop in stops if stop]
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"options.stop holds {len(stops)} strings; at most {MAX_STOPS}",
                       "options.stop")
    top_k = options.top_k if options.top_k is None or options.top_k >= 0 else None
    top_p = options.top_p
    if top_p == 0:
        top_p, top_k = None, 1
    predict = options.num_predict
    mapped: dict[str, Any] = {
        "stream": body.stream,
        "max_tokens": min(predict, _MAX_C_INT) if predict is not None and predict > 0 else None,
        "temperature": options.temperature,
        "top_k": min(top_k, _MAX_C_INT) if top_k is not None else None,
        "top_p": top_p,
        "min_p": options.min_p,
        "repeat_penalty": options.repeat_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "seed": options.seed % (1 << 63) if options.seed is not None and options.seed >= 0
        else None,
        "stop": stops or None,
        "logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    }
    mapped.update(_format(body.format))
    return mapped


def _format(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if value == "json":
        return {"format": "json"}
    if isinstance(value, dict):
        return {"json_schema": value}
    raise ApiError(400, f"format {value!r} is not \"json\" or a JSON Schema object", "format")
