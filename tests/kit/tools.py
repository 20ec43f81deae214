"""The tools the tests offer, a question for them and its history after a call; the
tool-call round trip the client examples do (clients/node/tools-example.js,
clients/go/cmd/sfcore-tools-example), and the checks of what they print with --json:
{tools, first: {finishReason, text}, calls: [{id, name, arguments, result}],
answer: {finishReason, text, toolCalls}}."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

# The tools both examples offer (those of tests/e2e/ndjson/test_tools.py): the test holds its own
# copy, so an example that offered other schemas would fail, not validate against them.
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
ADD: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "The sum of two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
# A question for both tools (tests/e2e/ndjson/test_tools.py, test_tools_native.py).
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
# The question, a call of add and its result, as a client sends them back.
CALLED = [*QUESTION,
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "5"}]

# Temperature 1.0 over these seeds: the calls are held to the tools whatever is sampled.
SEEDS = range(4)
# The flags of a round trip both examples take.
FLAGS = ["--json", "--temperature", "1.0", "--max-tokens", "64"]


def local_result(name: str, arguments: dict[str, Any]) -> str:
    """What the examples' functions answer (the result they send back)."""
    if name == "add":
        return str(arguments["a"] + arguments["b"])
    unit = "70 F" if arguments.get("unit") == "f" else "21 C"
    return f"{arguments['city']}: {unit}, sunny"


def assert_round_trip(out: str, names: set[str], *, single: bool = False) -> dict[str, Any]:
    """One --json line: the first answer called (each call one of `names`, its arguments
    valid against that tool's parameters, one call if `single`), each call was run and its
    result sent back, and the final answer is a done of its own."""
    assert out.endswith("\n") and out.count("\n") == 1, out
    trip: dict[str, Any] = json.loads(out)
    assert trip["tools"] == TOOLS
    assert trip["first"]["finishReason"] == "tool_calls", trip
    calls = trip["calls"]
    assert calls, trip
    if single:
        assert len(calls) == 1, trip
    for call in calls:
        assert call["id"].startswith("call_"), call
        assert call["name"] in names, call
        # Typed: the arguments came as a JSON object, not JSON text.
        assert isinstance(call["arguments"], dict), call
        jsonschema.validate(call["arguments"], PARAMETERS[call["name"]])
        # Integers past 2**53 are rounded by JSON readers of doubles (JS, Go's any), and
        # past 1e21 written back in exponent form (then read here as floats).
        if all(isinstance(value, int) and abs(value) < 2**53
               for value in call["arguments"].values() if isinstance(value, (int, float))):
            assert call["result"] == local_result(call["name"], call["arguments"]), call
    assert len({call["id"] for call in calls}) == len(calls), calls
    answer = trip["answer"]
    assert answer["finishReason"] in ("stop", "length", "tool_calls"), answer
    assert isinstance(answer["text"], str) and isinstance(answer["toolCalls"], list)
    assert (answer["finishReason"] == "tool_calls") == bool(answer["toolCalls"]), answer
    for call in answer["toolCalls"]:
        assert call["type"] == "function", call
        assert call["function"]["name"] in PARAMETERS, call
        jsonschema.validate(call["function"]["arguments"],
                            PARAMETERS[call["function"]["name"]])
    return trip
