"""Tool calls: the calls a chat answers with parse and validate, over NDJSON and OpenAI's API.

The live tests run the real daemon and model: with `tool_choice` "required" or a named
function every answer is a call whose name is one of the tools and whose arguments are
valid against that tool's parameters, at temperature 1.0 over many seeds and at a
max_tokens that leaves no room to spare (budget-aware closing ends the call in time).
The pure parts (the marker split of streamed text, the plan, reading calls) get
property tests.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_tools.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.core.request import ChatRequest, FunctionSpec, Message, Tool
from sfcore_daemon.core.tools import CALL_MARKER, MarkerSplit, plan, read_calls, render
from sfcore_daemon.structured.grammar import GrammarError


@settings(max_examples=300, deadline=None)
@given(before=st.text(max_size=40), after=st.text(max_size=40), cuts=st.lists(
    st.integers(min_value=0, max_value=100), max_size=8), marked=st.booleans())
def test_the_marker_split_gives_back_all_text_and_cuts_at_the_marker(
        before: str, after: str, cuts: list[int], marked: bool) -> None:
    text = before + (CALL_MARKER + after if marked else "")
    pieces, last = [], 0
    for cut in sorted(cut % (len(text) + 1) for cut in cuts):
        pieces.append(text[last:cut])
        last = cut
    pieces.append(text[last:])
    split = MarkerSplit()
    shown = "".join(split.feed(piece) for piece in pieces) + split.finish()
    at = text.find(CALL_MARKER)
    if at < 0:
        assert shown == text and split.call is None
    else:
        assert shown == text[:at]
        assert split.call is not None and "".join(split.call) == text[at + len(CALL_MARKER):]


def test_a_forced_split_takes_everything_as_the_call() -> None:
    split = MarkerSplit(forced=True)
    assert split.feed('[{"name"') == "" and split.finish() == ""
    assert split.call == ['[{"name"']


def test_reading_calls() -> None:
    calls = read_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}]\n')
    assert calls is not None and calls[0].function.arguments == {"a": 1, "b": 2}
    assert len({call.id for call in read_calls('[{"name": "a", "arguments": {}}, '
                                               '{"name": "b", "arguments": {}}]') or []}) == 2
    for broken in ('[{"name": "add", "arguments":', "[]", '{"name": "a"}', "x"):
        assert read_calls(broken) is None


def test_the_plan_and_the_rendering() -> None:
    request = ChatRequest(messages=[Message(role="system", content="Be brief."),
                                    Message(role="tool", content="1", tool_call_id="a"),
                                    Message(role="tool", content="2", tool_call_id="b")],
                          tools=[tool("a"), tool("b")])
    made = plan(request)
    assert made is not None and not made.forced
    assert made.schema["maxItems"] > 1 and len(made.schema["items"]["anyOf"]) == 2
    rendered = render(request, made)
    # The tools join the system message; two results in a row are one user turn.
    assert [role for role, _ in rendered] == ["system", "user"]
    assert rendered[0][1].startswith("Be brief.") and '"name": "b"' in rendered[0][1]
    assert rendered[1][1].count("<tool_response>") == 2
    with pytest.raises(GrammarError, match="two tools"):
        plan(ChatRequest(messages=[], tools=[tool("a"), tool("a")]))
    assert plan(ChatRequest(messages=[], tools=[tool("a")], tool_choice="none")) is None


def tool(name: str) -> Tool:
    return Tool(type="function", function=FunctionSpec(name=name))

