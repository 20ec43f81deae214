"""Messages' `cache_control` marks, parsed and mapped (anthropic/translate.py), fast: any
mark is refused with a 400 naming it, or becomes a `cache_marks` entry on the message
that holds the marked text, with its TTL; more than four is Anthropic's 400."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.anthropic import translate
from sfcore_daemon.anthropic.schema import count_tokens_decoder, messages_decoder
from sfcore_daemon.core.cachemarks import segment_cuts
from sfcore_daemon.core.chat import Segment
from sfcore_daemon.core.request import CacheMark, ChatRequest
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.openai.translate import ApiError

FAST = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TTL = {"5m": 300, "1h": 3600}

valid_controls = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"},
                                  {"type": "ephemeral", "ttl": "1h"}])
bad_controls = st.sampled_from([{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"},
                                {"type": "ephemeral", "ttl": 300}, {}, "ephemeral", 1])
controls = st.none() | valid_controls | valid_controls | bad_controls
texts = st.text(alphabet="ab ", max_size=4)


def block(text: str, control: Any) -> dict[str, Any]:
    return {"type": "text", "text": text} | ({"cache_control": control} if control else {})


text_blocks = st.builds(block, texts, controls)
results = st.builds(
    lambda content, control: {"type": "tool_result", "tool_use_id": "t1", "content": content}
    | ({"cache_control": control} if control else {}),
    texts | st.lists(text_blocks, max_size=2), controls)
turns = st.lists(st.tuples(st.sampled_from(["user", "assistant"]),
                           texts | st.lists(text_blocks | results, max_size=3)),
                 min_size=1, max_size=4)
tools = st.lists(st.builds(lambda control: {"name": "add", "input_schema": {"type": "object"}}
                           | ({"cache_control": control} if control else {}), controls),
                 max_size=2)
systems = st.none() | texts | st.lists(text_blocks, max_size=2)


def ttl_of(control: dict[str, Any]) -> int:
    return TTL[control.get("ttl", "5m")]


def expected_marks(body: dict[str, Any]) -> list[tuple[str, int]] | None:
    """The marks the body should map to, as (the marked message's role, or "before" for
    the prompt before the first message, TTL); None when a mark is malformed."""
    marks: list[tuple[str, int]] = []
    controls_seen: list[Any] = []
    for tool in body.get("tools", []):
        if "cache_control" in tool:
            controls_seen.append(tool["cache_control"])
            marks.append(("before", 0))
    system = body.get("system")
    if isinstance(system, list):
        has_system = bool("\n".join(part["text"] for part in system))
        for part in system:
            if "cache_control" in part:
                controls_seen.append(part["cache_control"])
                marks.append(("system" if has_system else "before", 0))
    for message in body["messages"]:
        if isinstance(message["content"], str):
            continue
        for item in message["content"]:
            inner = [part["cache_control"] for part in item.get("content", [])
                     if isinstance(part, dict) and "cache_control" in part] \
                if isinstance(item.get("content"), list) else []
            own = [item["cache_control"]] if "cache_control" in item else []
            controls_seen += own + inner
            if item["type"] == "tool_result":
                if message["role"] == "user" and (own or inner):
                    marks.append(("tool", 0))
            elif own:
                marks.append((message["role"], 0))
    if any(control not in ({"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"},
                           {"type": "ephemeral", "ttl": "1h"}) for control in controls_seen):
        return None
    return marks


@FAST
@given(turns, systems, tools)
def test_cache_control_maps_to_marks_on_the_messages_that_hold_the_text(
        chat: list[tuple[str, Any]], system: Any, offered: list[dict[str, Any]]) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "messages": [
        {"role": role, "content": content} for role, content in chat]}
    if system is not None:
        body["system"] = system
    if offered:
        body["tools"] = offered
    expected = expected_marks(body)
    for decoder in (messages_decoder, count_tokens_decoder):
        try:
            mapped = translate.chat_request(decoder.decode(msgspec.json.encode(body)), "id")
        except msgspec.ValidationError as exc:
            assert expected is None and "cache_control" in str(exc), exc
            continue
        except ApiError as exc:
            assert exc.status == 400 and exc.param is not None
            if expected is not None and len(expected) > 4:
                continue
            # Refused for a reason of its own (a tool_result in an assistant turn).
            assert "cache_control" not in exc.message, exc.message
            continue
        assert expected is not None and len(expected) <= 4
        check_marks(mapped, expected, body)


def check_marks(mapped: ChatRequest, expected: list[tuple[str, int]],
                body: dict[str, Any]) -> None:
    marks = mapped.cache_marks or []
    assert len(marks) == len(expected)
    roles = sorted(role for role, _ in expected)
    found = []
    for mark in marks:
        assert -1 <= mark.message < len(mapped.messages)
        assert mark.ttl_s in (300, 3600)
        found.append("before" if mark.message == -1 else mapped.messages[mark.message].role)
    assert sorted(found) == roles
    # Every marked text block's text is in the message its mark names.
    for message in body["messages"]:
        if isinstance(message["content"], str):
            continue
        for item in message["content"]:
            if item["type"] == "text" and "cache_control" in item:
                assert any(mark.ttl_s == ttl_of(item["cache_control"]) and mark.message >= 0
                           and item["text"] in mapped.messages[mark.message].content
                           for mark in marks)
    # Marks travel to the NDJSON protocol as the chat op's own field.
    line = msgspec.json.encode({"op": "chat", **msgspec.structs.asdict(mapped)})
    decoded = msgspec.json.decode(line, type=protocol.Request)
    assert msgspec.structs.asdict(decoded) == msgspec.structs.asdict(mapped)


def test_where_a_mark_ends_in_the_rendered_prompt() -> None:
    # system text, then the first turn's markup with tool definitions, user text, ...
    segments: list[Segment] = [
        ("<bos><turn>system\n", False), ("Be brief.", True),
        ("<end>\n<tools>add</tools>\n<turn>user\n", False), ("Hi", True),
        ("<end>\n<turn>model\n", False), ("Hello", True), ("<end>\n<turn>model\n", False)]
    roles = ["system", "user", "assistant"]
    ends = [2, 4, 6]
    origins = [0, 1, 2]

    def cuts(*marks: CacheMark) -> dict[int, int]:
        return segment_cuts(marks, origins, roles, ends, segments)

    # The system's mark takes the tool definitions and the next turn's opening.
    assert cuts(CacheMark(message=0)) == {3: 300}
    assert cuts(CacheMark(message=-1, ttl_s=3600)) == {3: 3600}
    # A message's mark ends at its text: the markup after it is the next turn's.
    assert cuts(CacheMark(message=1), CacheMark(message=2, ttl_s=3600),
                CacheMark(message=2)) == {4: 300, 6: 3600}
    # Without a system message, -1 is the markup before the first text.
    assert segment_cuts([CacheMark(message=-1)], [0, 1], ["user", "assistant"], [4, 6],
                        segments) == {1: 300}
    # A message the template left out, or one past the end, marks nothing.
    assert segment_cuts([CacheMark(message=0), CacheMark(message=5)], origins, roles,
                        [-1, 4, 6], segments) == {}
