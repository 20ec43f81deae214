"""Tool calls: how tools reach the prompt, what grammar a call is held to, and reading it.

A chat template that renders tools itself in the Hermes format (chat.takes_tools) gets
them as Hugging Face passes them, and a call is one `{"name", "arguments"}` object per
`<tool_call>` block. Any other template (the default model's takes no tools) gets one
generic format, described in a system message: a call is the marker `<tool_call>`
followed by a JSON array of `{"name": ..., "arguments": {...}}`. Earlier calls and tool
results in the conversation render in the same format, so the model sees one convention.

The call is decoded under a JSON Schema built from the tools (an array of objects, each
naming one tool and holding arguments valid against its parameters), through the same
schema compiler and budget-aware closing as `json_schema`: a call is complete and valid
even at a tight max_tokens. With `tool_choice` "required" or a named function the
answer starts as the call (the marker is the prompt's last text); with "auto" the model
writes text until it writes the marker, and the grammar holds it from there on.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any, Final, NamedTuple

import msgspec

from sfcore_daemon.core.request import ChatRequest, FunctionCall, Message, Tool, ToolCall
from sfcore_daemon.structured.grammar import GrammarError

CALL_MARKER: Final = "<tool_call>"
CALL_END: Final = "</tool_call>"
# Calls one answer may make (parallel calls) when no single function is named.
MAX_CALLS: Final = 8

_INTRO: Final = (
    "You can call functions. To call one or more, reply with " + CALL_MARKER
    + " followed by a JSON array of calls, each "
    '{"name": <function name>, "arguments": <arguments object>}, and nothing after it. '
    "A function's result comes back in a " "<tool_response> message.\n"
    "Functions:\n")
_REQUIRED: Final = "Call at least one function now.\n"


class ToolPlan(NamedTuple):
    """What a chat request with tools is held to."""

    # The calls' JSON Schema (compiled like a request's json_schema).
    schema: dict[str, Any]
    # True: the answer is the call from its first token ("required", a named
    # function); False: text until the model writes CALL_MARKER ("auto").
    forced: bool


def plan(request: ChatRequest, native: bool = False) -> ToolPlan | None:
    """The call's schema and how it starts; None when no call may be made. GrammarError
    (invalid_request) for tools that cannot be offered. `native`: the model's template
    renders the tools, and its format is one call object per `<tool_call>` block."""
    tools = request.tools or []
    names = [tool.function.name for tool in tools]
    seen: set[str] = set()
    for index, name in enumerate(names):
        if name in seen:
            raise GrammarError(f"two tools are named {name!r} - at "
                               f"`$.tools[{index}].function.name`")
        seen.add(name)
    choice = request.tool_choice
    most = MAX_CALLS if request.parallel_tool_calls else 1
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise GrammarError('tool_choice "required" needs tools - at `$.tool_choice`')
        if choice == "none" or not tools:
            return None
        return ToolPlan(calls_schema(tools, most, native), forced=choice == "required")
    if choice is None:
        return ToolPlan(calls_schema(tools, most, native), forced=False) if tools else None
    chosen = [tool for tool in tools if tool.function.name == choice.function.name]
    if not chosen:
        raise GrammarError(f"tool_choice names {choice.function.name!r}, which is not among "
                           "the tools - at `$.tool_choice.function.name`")
    return ToolPlan(calls_schema(chosen, 1, native), forced=True)


def calls_schema(tools: Sequence[Tool], max_calls: int, one: bool = False) -> dict[str, Any]:
    """A JSON array of 1 to `max_calls` calls, each of one of `tools`; with `one`, a
    single call object (the Hermes format's block)."""
    alternatives = [_call_schema(tool) for tool in tools]
    item = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    if one:
        return item
    return {"type": "array", "items": item, "minItems": 1, "maxItems": max_calls}


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters
    arguments = parameters if parameters else {"type": "object"}
    return {"type": "object",
            "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def render(request: ChatRequest, tool_plan: ToolPlan | None,
           origins: list[int] | None = None) -> list[tuple[str, str]]:
    """The messages as (role, content) for the chat template: tools described in the
    system message, calls and results in the generic format, turns that the template
    would see twice in a row (a tool result after a tool result) merged. `origins`, if
    given, gets the index in the result of each of the request's messages."""
    messages = list(request.messages)
    rendered: list[tuple[str, str]] = []
    where = origins if origins is not None else []
    if tool_plan is not None and request.tools:
        description = _INTRO + "\n".join(
            json.dumps({"name": tool.function.name,
                        "description": tool.function.description,
                        "parameters": tool.function.parameters or {"type": "object"}},
                       ensure_ascii=False)
            for tool in request.tools)
        if tool_plan.forced:
            description += "\n" + _REQUIRED
        if messages and messages[0].role == "system":
            rendered.append(("system", messages.pop(0).content + "\n\n" + description))
            where.append(0)
        else:
            rendered.append(("system", description))
    for message in messages:
        role, content = _generic(message)
        if rendered and rendered[-1][0] == role and role != "system":
            rendered[-1] = (role, rendered[-1][1] + "\n\n" + content)
        else:
            rendered.append((role, content))
        where.append(len(rendered) - 1)
    return rendered


def _generic(message: Message) -> tuple[str, str]:
    if message.role == "tool":
        return "user", f"<tool_response>\n{message.content}\n</tool_response>"
    if message.role == "assistant" and message.tool_calls:
        calls = json.dumps([{"name": call.function.name, "arguments": call.function.arguments}
                            for call in message.tool_calls], ensure_ascii=False)
        text = f"{message.content}\n" if message.content else ""
        return "assistant", f"{text}{CALL_MARKER}\n{calls}\n{CALL_END}"
    return message.role, message.content


def native_render(request: ChatRequest, tool_plan: ToolPlan | None,
                  ) -> tuple[list[tuple[str, str]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages, their tool fields and the tools, for a template that renders tools
    itself (chat.ChatTemplate.render); "none" shows the template no tools."""
    messages: list[tuple[str, str]] = []
    extras: list[dict[str, Any]] = []
    for message in request.messages:
        fields: dict[str, Any] = {}
        if message.tool_calls:
            fields["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": call.function.arguments}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            fields["tool_call_id"] = message.tool_call_id
        messages.append((message.role, message.content))
        extras.append(fields)
    definitions = [{"type": "function", "function": {
        "name": tool.function.name, "description": tool.function.description,
        "parameters": tool.function.parameters or {"type": "object", "properties": {}}}}
        for tool in request.tools or ()]
    return messages, extras, definitions if tool_plan is not None else []


def uses_tools(request: ChatRequest) -> bool:
    """Whether rendering the request needs this module (tools, calls or results)."""
    return bool(request.tools) or any(
        message.role == "tool" or message.tool_calls for message in request.messages)


_calls_decoder = msgspec.json.Decoder(list[FunctionCall] | FunctionCall)


def read_calls(text: str) -> list[ToolCall] | None:
    """The calls in `text` (what followed the marker: an array of calls, or one call in
    the Hermes format), each given an id; None when it is not whole calls (an "auto"
    answer cut before its grammar could close it)."""
    try:
        read = _calls_decoder.decode(text.strip().removesuffix(CALL_END).strip())
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    calls = [read] if isinstance(read, FunctionCall) else read
    if not calls:
        return None
    return [ToolCall(id="call_" + secrets.token_hex(12), function=call) for call in calls]


class MarkerSplit:
    """Splits streamed text at the first CALL_MARKER: what comes before is text (held
    back only while it might be the marker's beginning), what comes after is the call."""

    __slots__ = ("_held", "call", "forced")

    def __init__(self, forced: bool = False) -> None:
        self._held = ""
        # The call starts the answer (its marker is the prompt's last text).
        self.forced = forced
        # The call's text once the marker was seen (from the start when forced).
        self.call: list[str] | None = [] if forced else None

    def feed(self, text: str) -> str:
        """The text that can be emitted now."""
        if self.call is not None:
            self.call.append(text)
            return ""
        pending = self._held + text
        at = pending.find(CALL_MARKER)
        if at >= 0:
            self._held = ""
            self.call = [pending[at + len(CALL_MARKER):]]
            return pending[:at]
        keep = _partial_marker(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def finish(self) -> str:
        """The end: text held back as a possible marker is text after all."""
        held, self._held = self._held, ""
        return held


def _partial_marker(text: str) -> int:
    """The length of the longest end of `text` that begins CALL_MARKER."""
    for size in range(min(len(text), len(CALL_MARKER) - 1), 0, -1):
        if CALL_MARKER.startswith(text[-size:]):
            return size
    return 0
