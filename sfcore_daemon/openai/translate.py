"""What maps to what: OpenAI requests to the daemon's own, its replies back to OpenAI's.

A chat or completions body becomes the core's `ChatRequest` or `GenerateRequest`, so
every front end's requests go through the same admission, scheduler, prompt store and
limits. A value the daemon cannot honour is an `ApiError`
(OpenAI's error shape, with the field as `param`), never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

from sfcore_daemon.core.request import (
    MAX_STOPS,
    ChatRequest,
    ChosenFunction,
    ChosenTool,
    FunctionCall,
    FunctionSpec,
    GenerateRequest,
    Message,
    Tool,
    ToolCall,
)
from sfcore_daemon.core.result import Result, TokenLogprob
from sfcore_daemon.httpd.api import tier_priority
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.openai.schema import (
    ChatCompletionRequest,
    ChatMessage,
    ChoiceLogprobs,
    ChosenToolIn,
    CompletionRequest,
    CompletionUsage,
    FunctionCallOut,
    LegacyLogprobs,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprobOut,
    ToolCallOut,
    TopLogprobOut,
)

# --- requests -------------------------------------------------------------------------


def chat_request(body: ChatCompletionRequest, request_id: str) -> ChatRequest:
    if body.functions:
        raise ApiError(400, "functions (OpenAI's older form) are not supported: send tools",
                       "functions", "unsupported")
    if not body.messages:
        raise ApiError(400, "messages must hold at least one message", "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    messages = [_message(index, message) for index, message in enumerate(body.messages)]
    max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                  else body.max_tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return ChatRequest(id=request_id, messages=messages, **_tool_options(body),
                       **_options(body, max_tokens, logprobs),
                       prompt_cache_key=body.prompt_cache_key)


def _tool_options(body: ChatCompletionRequest) -> dict[str, Any]:
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return {}
    choice = body.tool_choice
    return {
        "tools": [Tool(type="function", function=FunctionSpec(
            name=tool.function.name, description=tool.function.description,
            parameters=tool.function.parameters, strict=tool.function.strict))
            for tool in body.tools],
        "tool_choice": (ChosenTool(type="function",
                                   function=ChosenFunction(name=choice.function.name))
                        if isinstance(choice, ChosenToolIn) else choice),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
    }


def completion_request(body: CompletionRequest, request_id: str) -> GenerateRequest:
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(400, "prompt must be a string or a list of one string: one request "
                           "is one generation here (send several requests; they run in "
                           "parallel slots), and token arrays are not taken", "prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo", "unsupported")
    if body.suffix:
        raise ApiError(400, "suffix (fill-in-the-middle) is not supported", "suffix",
                       "unsupported")
    if body.best_of not in (None, 1):
        raise ApiError(400, "best_of must be 1", "best_of")
    return GenerateRequest(id=request_id, prompt=prompt,
                           **_options(body, body.max_tokens, body.logprobs))


def _message(index: int, message: ChatMessage) -> Message:
    where = f"messages[{index}]"
    role = message.role
    if role == "developer":  # OpenAI's newer name for system instructions
        role = "system"
    if role == "function":
        raise ApiError(400, "function messages (OpenAI's older form) are not supported: "
                       "send tool messages", f"{where}.role", "unsupported")
    if role not in ("system", "user", "assistant", "tool"):
        raise ApiError(400, f"role {message.role!r} is not one of system, developer, user, "
                       "assistant, tool", f"{where}.role")
    calls = None
    if message.tool_calls:
        if role != "assistant":
            raise ApiError(400, "only an assistant message carries tool_calls",
                           f"{where}.tool_calls")
        calls = [ToolCall(id=call.id, function=FunctionCall(
            name=call.function.name,
            arguments=_arguments(call.function.arguments,
                                 f"{where}.tool_calls[{number}].function.arguments")))
                 for number, call in enumerate(message.tool_calls)]
    content = message.content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported: "
                               "the model reads text only", f"{where}.content[{number}].type",
                               "unsupported")
            texts.append(part.text)
        content = "\n".join(texts)
    return Message(role=role, content=content or "", tool_calls=calls,  # type: ignore[arg-type]
                   tool_call_id=message.tool_call_id if role == "tool" else None)


def _arguments(text: str, where: str) -> dict[str, Any]:
    """An earlier call's arguments, which OpenAI sends as JSON text: an object."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        raise ApiError(400, "a call's arguments must be a JSON object (as text)",
                       where) from None
    if not isinstance(value, dict):
        raise ApiError(400, "a call's arguments must be a JSON object (as text)", where)
    return value


def _options(body: SamplingFields, max_tokens: int | None,
             logprobs: int | None) -> dict[str, Any]:
    """The generation fields both requests share, checked."""
    if body.n not in (None, 1):
        raise ApiError(400, "n must be 1: the daemon generates one choice per request (send "
                       "n requests; they run side by side in its slots)", "n")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    stops = [stop for stop in stops if stop]
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    options: dict[str, Any] = {
        "stream": body.stream,
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repeat_penalty": body.repeat_penalty,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        # The sampler folds any integer into its 32-bit seed range.
        "seed": body.seed % (1 << 63) if body.seed is not None else None,
        "stop": stops or None,
        "logprobs": logprobs,
        "priority": tier_priority(body.service_tier),
    }
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        options["format"] = "json"
    elif response_format is not None and response_format.type == "json_schema":
        wrapper = response_format.json_schema
        schema = wrapper.json_schema if wrapper is not None else None
        if schema is None or schema is False:
            raise ApiError(400, "response_format json_schema needs json_schema.schema (an "
                           "object)", "response_format.json_schema.schema")
        options["json_schema"] = {} if schema is True else schema
    return options


# --- replies --------------------------------------------------------------------------


def finish_reason(done: Result) -> str:
    """OpenAI's finish_reason. A JSON document closed early to fit max_tokens is
    "length" (it still parses); a generation cut by a stopping daemon is "length" too,
    since OpenAI's clients know no other word for text that ended early."""
    if done.tool_calls:
        return "tool_calls"
    return "length" if done.cut_short else "stop"


def tool_calls(done: Result) -> list[ToolCallOut] | None:
    """The answer's calls in OpenAI's shape (arguments as JSON text)."""
    if not done.tool_calls:
        return None
    return [ToolCallOut(id=call.id, function=FunctionCallOut(
        name=call.function.name,
        arguments=json.dumps(call.function.arguments, ensure_ascii=False)))
        for call in done.tool_calls]


def usage(done: Result) -> CompletionUsage:
    counts = done.usage
    return CompletionUsage(
        prompt_tokens=counts.prompt_tokens, completion_tokens=counts.completion_tokens,
        total_tokens=counts.prompt_tokens + counts.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached_tokens))


def chat_logprobs(entries: list[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprobOut(token=entry.text, logprob=entry.logprob, bytes=entry.bytes,
                        top_logprobs=[TopLogprobOut(token=top.text, logprob=top.logprob,
                                                    bytes=top.bytes)
                                      for top in entry.top_logprobs])
        for entry in entries])


def legacy_logprobs(entries: list[TokenLogprob], offset: int) -> LegacyLogprobs:
    """The completions API's lists; `offset`: characters of the reply before them."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.text)
    return LegacyLogprobs(
        tokens=[entry.text for entry in entries],
        token_logprobs=[entry.logprob for entry in entries],
        top_logprobs=[{top.text: top.logprob for top in entry.top_logprobs}
                      for entry in entries],
        text_offset=offsets)
