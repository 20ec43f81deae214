"""Tool calls through a chat template that renders tools itself (the Hermes format).

A configured Jinja template that takes `tools` and writes calls as `<tool_call>`
blocks is used as the model's own would be: the tools, the assistant's earlier calls and
the tool results reach the model through it (the prompt is exactly its rendering), and
a call is one JSON object per block, held to the tools' schema like any other.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jsonschema
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.kit import running_daemon
from tests.kit.tools import CALLED, PARAMETERS, QUESTION, TOOLS

pytestmark = pytest.mark.asyncio

HERMES = """\
{%- if tools %}<start_of_turn>user
# Tools
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><end_of_turn>
{% endif %}
{%- for message in messages %}
{%- if message.role == "tool" %}<start_of_turn>user
<tool_response>{{ message.content }}</tool_response><end_of_turn>
{% elif message.tool_calls is defined %}<start_of_turn>model
{% for call in message.tool_calls %}<tool_call>{{ {"name": call.function.name, \
"arguments": call.function.arguments} | tojson }}</tool_call>{% endfor %}<end_of_turn>
{% else %}<start_of_turn>{{ "model" if message.role == "assistant" else message.role }}
{{ message.content }}<end_of_turn>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


def rendered(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                undefined=jinja2.StrictUndefined)
    definitions = None if tools is None else [
        {"type": "function", "function": {
            "name": tool["function"]["name"],
            "description": tool["function"].get("description", ""),
            "parameters": tool["function"].get("parameters")
            or {"type": "object", "properties": {}}}} for tool in tools]
    return environment.from_string(HERMES).render(
        messages=messages, tools=definitions, add_generation_prompt=True, bos_token="<bos>",
        eos_token="<eos>")


async def test_a_template_that_takes_tools_renders_them_and_its_calls_validate() -> None:
    config = {"model": {"chat_template": HERMES}, "server": {"slots": 4}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        # The prompt is the template's own rendering: the tools, an earlier call, a result.
        done = await client.final({"op": "chat", "messages": CALLED, "tools": TOOLS,
                                   "max_tokens": 1, "temperature": 0})
        assert done["type"] == "done", done
        wire_history = [*QUESTION,
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"id": "call_1", "type": "function",
                             "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                        {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
        expected = await client.final({"op": "tokenize",
                                       "text": rendered(wire_history, TOOLS)})
        assert done["usage"]["prompt_tokens"] == len(expected["tokens"])
        assert "You can call functions" not in rendered(wire_history, TOOLS)
        # Forced calls: one object per block, valid, at temperature 1.0 and a tight budget.
        requests = [{"op": "chat", "id": seed, "messages": QUESTION, "tools": TOOLS,
                     "tool_choice": choice, "max_tokens": 16, "temperature": 1.0,
                     "seed": seed, "stream": False}
                    for seed in range(6)
                    for choice in ("required", {"type": "function", "function": {"name": "add"}})]
        for request in requests:
            request["id"] = f"{request['id']}-{json.dumps(request['tool_choice'])}"
        await client.send(*requests)
        for _ in requests:
            reply = await client.recv()
            assert reply is not None and reply["type"] == "done", reply
            assert reply["finish_reason"] == "tool_calls", reply
            (call,) = reply["tool_calls"]
            name = call["function"]["name"]
            assert name in PARAMETERS
            if "add" in reply["id"].split("-", 1)[1]:
                assert name == "add"
            jsonschema.validate(call["function"]["arguments"], PARAMETERS[name])
        # Without tools the same template renders as before (tools none).
        plain = await client.final({"op": "chat", "messages": QUESTION, "max_tokens": 1})
        expected = await client.final({"op": "tokenize", "text": rendered(QUESTION, None)})
        assert plain["usage"]["prompt_tokens"] == len(expected["tokens"])
