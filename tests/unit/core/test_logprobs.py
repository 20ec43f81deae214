"""Logprobs (`logprobs: N` on generate and chat): the numbers of a logits row, the entries'
way into the lines, the request field, and the real daemon end to end.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_logprobs.py.
"""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.core import errors
from sfcore_daemon.core.logprobs import LogprobTrail
from sfcore_daemon.core.request import ChatRequest, GenerateRequest
from sfcore_daemon.core.textstream import TextStream
from sfcore_daemon.llama.logprobs import RowLogprobs, TokenLogprobs
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.ndjson.protocol import RequestError


def reference(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    wide = logits.astype(np.float64)
    return wide - (wide.max() + math.log(np.exp(wide - wide.max()).sum()))


@pytest.mark.parametrize("top", [0, 1, 5, 20])
@pytest.mark.parametrize("n_vocab", [262_144, 50_000, 60])
def test_row_numbers_are_the_log_softmax_and_its_best(top: int, n_vocab: int) -> None:
    rng = np.random.default_rng(top)
    rows = RowLogprobs(n_vocab)
    for _ in range(3):  # the scratch buffers are reused
        logits = (rng.standard_normal(n_vocab) * 4).astype(np.float32)
        token = int(rng.integers(n_vocab))
        expected = reference(logits)
        chosen, ids, values = rows.of(logits, token, top)
        assert chosen == pytest.approx(expected[token], abs=1e-4)
        assert ids == np.argsort(-expected, kind="stable")[:top].tolist()
        assert values == pytest.approx(expected[ids].tolist(), abs=1e-4)
        assert values == sorted(values, reverse=True)
        assert all(value <= 0 for value in values)
        if top:
            best, best_numbers = ids[0], rows.of(logits, ids[0], top)
            assert best_numbers[0] == best_numbers[2][0]  # the same number, not just close
            assert best == int(logits.argmax())


@pytest.mark.parametrize("n_vocab", [262_144, 1000])
def test_equal_logits_rank_the_lower_id_first_and_a_flat_row_is_uniform(n_vocab: int) -> None:
    rows = RowLogprobs(n_vocab)
    logits = np.zeros(n_vocab, np.float32)
    same_column = 3 + n_vocab // 64  # as 3 (RowLogprobs._best)
    logits[[900, 7, 3, same_column]] = 5.0
    _, ids, values = rows.of(logits, 3, 5)
    assert ids == [*sorted([3, 7, 900, same_column]), 0]
    assert values[0] == values[3] > values[4]
    flat = np.full(n_vocab, -3.0, np.float32)
    chosen, ids, _ = rows.of(flat, 999, 2)
    assert chosen == pytest.approx(-math.log(n_vocab), abs=1e-4)
    assert ids == [0, 1]
    # Near-ties that differ in the last bit keep their order.
    logits[11] = np.nextafter(np.float32(5.0), np.float32(6.0))
    assert rows.of(logits, 3, 2)[1] == [11, 3]


Lines = list[tuple[str, list[int]]]


def run_trail(pieces: list[bytes], stops: tuple[str, ...] = ()) -> tuple[Lines, list[int]]:
    """Feed `pieces` (token i has the id i) as the output pipeline does: the lines
    (text, the ids of their entries) and, at the end, the ids no line took."""
    numbers = deque(TokenLogprobs(index, -0.5, [], [], []) for index in range(len(pieces)))
    stream, trail = TextStream(stops), LogprobTrail(numbers)
    lines = []
    for piece in pieces:
        text, entries = trail.feed(stream, piece)
        if text:
            lines.append((text, [entry.token for entry in entries]))
        else:
            assert entries == []
        if stream.stop_hit is not None:
            return lines, []
    tail = stream.finish()
    if tail:
        lines.append((tail, [entry.token for entry in trail.emitted(len(tail))]))
    return lines, [entry.token for entry in trail.rest()]


def test_each_token_rides_with_the_line_its_text_starts_in() -> None:
    assert run_trail([b"Hel", b"lo", b" w"]) == ([("Hel", [0]), ("lo", [1]), (" w", [2])], [])
    # A character split over three tokens: all three go with the line that has it.
    assert run_trail([b"a\xe2", b"\x82", b"\xacb"]) == ([("a", [0]), ("\u20acb", [1, 2])], [])
    # An empty piece goes with the next character's line.
    assert run_trail([b"x", b"", b"y"]) == ([("x", [0]), ("y", [1, 2])], [])


def test_stop_holdback_delays_entries_and_a_cut_drops_them() -> None:
    # "\n" might start "\n\n": held, then released with the next token's text.
    assert run_trail([b"a\n", b"b"], ("\n\n",)) == ([("a", [0]), ("\nb", [1])], [])
    # Held to the end: released by `finish` with the entry.
    assert run_trail([b"a", b"\n"], ("\n\n",)) == ([("a", [0]), ("\n", [1])], [])
    # Cut: the tokens wholly inside the stop sequence get no entry; one whose text
    # starts before it does.
    assert run_trail([b"a", b"\n", b"\n", b"c"], ("\n\n",)) == ([("a", [0])], [])
    assert run_trail([b"ab\n\nc"], ("\n\n",)) == ([("ab", [0])], [])


def test_bytes_that_never_form_a_character_are_left_for_done() -> None:
    assert run_trail([b"ok", b"\xe2\x82"]) == ([("ok", [0])], [1])
    assert run_trail([b"\xff", b"ok"]) == ([("ok", [0, 1])], [])


def test_an_entry_carries_the_token_its_bytes_and_its_alternatives() -> None:
    trail = LogprobTrail(deque([TokenLogprobs(42, -0.25, [42, 7], [-0.25, -2.0],
                                              [b"\xe2\x82", b"x"])]))
    text, entries = trail.feed(TextStream(), b"hi")
    assert text == "hi"
    assert json.loads(protocol.encode_line(protocol.TokenReply(
        id=1, text=text, logprobs=entries))) == {
        "type": "token", "id": 1, "text": "hi", "logprobs": [{
            "token": 42, "text": "hi", "bytes": [104, 105], "logprob": -0.25,
            "top_logprobs": [
                {"token": 42, "text": "\ufffd", "bytes": [226, 130], "logprob": -0.25},
                {"token": 7, "text": "x", "bytes": [120], "logprob": -2.0}]}]}
    assert json.loads(protocol.encode_line(protocol.TokenReply(id=1, text="x"))) == {
        "type": "token", "id": 1, "text": "x"}


@pytest.mark.parametrize("value", [0, 1, 20])
def test_logprobs_field_takes_0_to_20(value: int) -> None:
    for line in ({"prompt": "x", "logprobs": value},
                 {"op": "chat", "messages": [{"role": "user", "content": "x"}],
                  "logprobs": value}):
        request = protocol.decode_request(json.dumps(line).encode())
        assert isinstance(request, GenerateRequest | ChatRequest)
        assert request.logprobs == value


# Strict JSON values (no NaN, no lone surrogates): anything else is bad_json, whatever
# the field (tests/e2e/ndjson/test_property.py sends those).
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-3, 30)
    | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(texts, children, max_size=3),
    max_leaves=6)


@settings(max_examples=300, deadline=None, database=None)
@given(value=json_values)
def test_any_json_value_for_logprobs_decodes_or_is_invalid_request(value: Any) -> None:
    line = json.dumps({"id": 5, "prompt": "x", "logprobs": value}, allow_nan=True).encode()
    try:
        request = protocol.decode_request(line)
    except RequestError as error:
        assert error.code == errors.INVALID_REQUEST
        assert "$.logprobs" in error.message and error.request_id == 5
        return
    assert isinstance(request, GenerateRequest)
    assert value is None or (type(value) is int and 0 <= value <= 20)
    assert request.logprobs == value
