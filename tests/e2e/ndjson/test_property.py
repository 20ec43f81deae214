"""Property-based tests of the framing and the error handling: arbitrary bytes and
arbitrary JSON values sent as request lines to ONE real daemon per property.

For every exchange: every non-blank line gets exactly one final reply line, in
order, each reply is a JSON object with `id` and `type`, a request with a readable
id gets it back, no line costs the connection or the daemon, and blank lines get
nothing. Generations are kept short by config (max_tokens 2) and by capping any
explicit max_tokens, so examples stay fast.
"""

from __future__ import annotations

import json
import math
import socket
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kit import (
    ERROR_CODES,
    FINAL_TYPES,
    BackgroundDaemon,
    connect_raw,
    parse_reply_lines,
    read_to_end,
)
from tests.kit.faults import assert_serves

CONFIG = {"generation": {"max_tokens": 2}, "model": {"n_ctx": 2048},
          "server": {"max_queue": 256}}
# Errors that close the connection: none of them can come from a short request line.
CLOSING_CODES = frozenset({"line_too_long", "too_many_connections", "forbidden",
                           "shutting_down"})
PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, database=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much])


# --- what a line should get --------------------------------------------------------------


def is_blank(line: bytes) -> bool:
    return not line.strip()


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate keys")
    return dict(pairs)


def _clean(value: Any) -> bool:
    """No lone surrogates and no non-finite numbers anywhere (strict JSON)."""
    if isinstance(value, str):
        return not any("\ud800" <= ch <= "\udfff" for ch in value)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_clean(v) for v in value)
    if isinstance(value, dict):
        return all(_clean(k) and _clean(v) for k, v in value.items())
    return True


def readable_id(line: bytes) -> Any:
    """The request's id when the line is strict JSON (an object whose `id` is a string
    or an integer), so the daemon can and must echo it; else None."""
    try:
        text = line.decode("utf-8")
        document = json.loads(text, parse_constant=_reject_constant,
                              object_pairs_hook=_no_duplicate_keys)
    except ValueError:
        return None
    if not isinstance(document, dict) or not _clean(document):
        return None
    request_id = document.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int):
        return None
    return request_id


def exchange(path: str, blob: bytes) -> tuple[list[dict[str, Any]], str]:
    sock = connect_raw(path, 60)
    try:
        sock.sendall(blob)
        sock.shutdown(socket.SHUT_WR)
        data, ended = read_to_end(sock)
    finally:
        sock.close()
    return parse_reply_lines(data), ended


def check_exchange(background: BackgroundDaemon, blob: bytes, seen: Counter[str]) -> None:
    daemon = background.daemon
    assert blob.endswith(b"\n")
    lines = blob.split(b"\n")[:-1]
    wanted = [line for line in lines if not is_blank(line)]
    replies, ended = exchange(daemon.socket_path, blob)
    assert ended == "eof", (ended, replies)
    # Group the replies: any `token` lines, then exactly one final line, per request.
    groups: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for reply in replies:
        current.append(reply)
        if reply["type"] in FINAL_TYPES:
            groups.append(current)
            current = []
        else:
            assert reply["type"] in ("token", "queued"), reply
    assert not current, f"replies after the last final line: {current}"
    assert len(groups) == len(wanted), (len(groups), len(wanted), wanted, replies)
    for line, group in zip(wanted, groups, strict=True):
        final = group[-1]
        assert all(r["id"] == final["id"] for r in group), group
        if len(group) > 1:
            assert final["type"] == "done", group
        if final["type"] == "error":
            assert final["code"] in ERROR_CODES - CLOSING_CODES, (line, final)
            assert final["code"] != "internal", (line, final)
            assert isinstance(final["message"], str) and final["message"], final
        seen[final.get("code", final["type"])] += 1
        request_id = readable_id(line)
        if request_id is not None:
            assert final["id"] == request_id, (line, final)
    assert daemon.process.returncode is None, daemon.log


# --- strategies ----------------------------------------------------------------------------

FIELDS = ["op", "id", "prompt", "stream", "max_tokens", "temperature", "top_k", "top_p",
          "min_p", "repeat_penalty", "seed", "stop", "cache_prompt", "messages", "text",
          "add_special", "tokens", "target", "action", "logprobs", "priority", "bogus"]
OPS = ["generate", "chat", "tokenize", "detokenize", "info", "stats", "health", "cancel",
       "cache", "list", "nope", "", "HEALTH"]

json_leaves = (st.none() | st.booleans() | st.integers() | st.integers(-3, 300_000)
               | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(max_size=24) | st.sampled_from(OPS))
json_values = st.recursive(
    json_leaves,
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=10)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]),
     "content": st.text(max_size=40) | json_leaves}), max_size=3)
ids = st.none() | st.integers() | st.text(max_size=12) | json_leaves

request_like = st.dictionaries(
    st.sampled_from(FIELDS),
    json_values | st.sampled_from(OPS) | messages | ids,
    max_size=6)
plausible_requests = st.one_of(
    st.builds(lambda i: {"op": "health", "id": i}, ids),
    st.builds(lambda i, t, a: {"op": "tokenize", "id": i, "text": t, "add_special": a},
              ids, st.text(max_size=80), st.booleans()),
    st.builds(lambda i, t: {"op": "detokenize", "id": i, "tokens": t},
              ids, st.lists(st.integers(0, 262_143), max_size=12)),
    st.builds(lambda i, p, n, s: {"id": i, "prompt": p, "max_tokens": n, "stream": s},
              ids, st.text(max_size=60), st.integers(1, 3), st.booleans()),
    st.builds(lambda i, m: {"op": "chat", "id": i, "messages": m, "max_tokens": 2},
              ids, messages),
    st.builds(lambda i, p, n: {"id": i, "prompt": p, "max_tokens": 2, "logprobs": n},
              ids, st.text(max_size=20), st.integers(-2, 22) | json_leaves),
    st.builds(lambda i, p, s: {"id": i, "prompt": "Hi", "max_tokens": 2, "priority": p,
                               "stream": s},
              ids, st.sampled_from(["interactive", "background", "urgent", ""]) | json_leaves,
              st.booleans()),
    st.builds(lambda i, t: {"op": "cancel", "id": i, "target": t}, ids, ids),
    st.builds(lambda i, o: {"op": o, "id": i}, ids, st.sampled_from(OPS)),
)


def cap_generation(value: Any) -> Any:
    """No example may start a long generation: cap any explicit max_tokens."""
    if isinstance(value, dict):
        tokens = value.get("max_tokens")
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 3:
            value = {**value, "max_tokens": 2}
    return value


@st.composite
def json_lines(draw: st.DrawFn) -> bytes:
    value = cap_generation(draw(st.one_of(plausible_requests, request_like, json_values)))
    ascii_only = draw(st.booleans())
    text = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True)
    # Lone surrogates: escaped (\ud800) when ascii_only, raw (invalid UTF-8) otherwise.
    return text.encode("utf-8", "surrogatepass")


def normalize_blank(line: bytes) -> bytes:
    # Only vertical tab / form feed (Python's whitespace, not JSON's): whether such a
    # line is "blank" is not specified, so the byte strategy does not send it alone.
    if is_blank(line) and line.strip(b" \t\r"):
        return line + b"x"
    return line


@st.composite
def byte_blobs(draw: st.DrawFn) -> bytes:
    parts = draw(st.lists(st.binary(max_size=120) | st.sampled_from(
        [b"", b"  ", b"\t\r", b"{}", b"[", b"{\"op\":\"health\"}", b"\xff", b"\\ud800"]),
        min_size=1, max_size=10))
    lines = [normalize_blank(line) for line in b"\n".join(parts).split(b"\n")]
    return b"\n".join(lines) + b"\n"


@st.composite
def json_blobs(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(json_lines() | st.sampled_from([b"", b"   ", b"\t"]),
                          min_size=1, max_size=8))
    return b"\n".join(lines) + b"\n"


# --- the properties ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_arbitrary_bytes_each_line_gets_exactly_one_final_reply_in_order() -> None:
    with BackgroundDaemon(CONFIG) as background:

        seen: Counter[str] = Counter()

        @PROPERTY_SETTINGS
        @given(byte_blobs())
        def prop(blob: bytes) -> None:
            check_exchange(background, blob, seen)

        prop()
        print("final replies:", dict(seen))
        assert seen["bad_json"] and seen["health"], seen  # the examples reached the daemon
        background.run(assert_serves(background.daemon))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_arbitrary_json_values_each_line_gets_exactly_one_final_reply_in_order() -> None:
    with BackgroundDaemon(CONFIG) as background:

        seen: Counter[str] = Counter()

        @PROPERTY_SETTINGS
        @given(json_blobs())
        def prop(blob: bytes) -> None:
            check_exchange(background, blob, seen)

        prop()
        print("final replies:", dict(seen))
        # The examples covered the ops' replies and both error classes.
        for kind in ("done", "tokens", "text", "health", "cancelled", "bad_json",
                     "invalid_request"):
            assert seen[kind], (kind, seen)
        background.run(assert_serves(background.daemon))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_arbitrary_lines_on_one_long_lived_connection() -> None:
    # The same, but every example on ONE connection: nothing a line does may leave
    # state behind that confuses the next request's reply.
    with BackgroundDaemon(CONFIG) as background:
        sock = connect_raw(background.daemon.socket_path, 60)
        reader = sock.makefile("rb")
        try:

            @PROPERTY_SETTINGS
            @given(st.lists(json_lines() | st.binary(max_size=60).map(
                lambda b: b.replace(b"\n", b" ")), min_size=1, max_size=6))
            def prop(lines: list[bytes]) -> None:
                lines = [normalize_blank(line) for line in lines]
                marker = f"mark-{id(lines)}"
                sock.sendall(b"\n".join(lines) + b"\n"
                             + json.dumps({"op": "health", "id": marker}).encode() + b"\n")
                wanted = sum(not is_blank(line) for line in lines)
                finals = 0
                while True:
                    raw = reader.readline()
                    assert raw.endswith(b"\n"), f"connection ended: {raw!r}"
                    reply = parse_reply_lines(raw)[0]
                    if reply["type"] not in FINAL_TYPES:
                        continue
                    if reply["id"] == marker and reply["type"] == "health":
                        break
                    finals += 1
                    assert reply["type"] != "error" or reply["code"] not in CLOSING_CODES
                assert finals == wanted, (finals, wanted, lines)

            prop()
        finally:
            reader.close()
            sock.close()
        background.run(assert_serves(background.daemon))
