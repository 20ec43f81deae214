"""Logprobs (`logprobs: N` on generate and chat): the numbers of a logits row, the entries'
way into the lines, the request field, and the real daemon end to end."""

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
from tests.harness import Client, done_of, running_daemon

# --- the numbers of a row --------------------------------------------------------------


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


# --- entries into lines -----------------------------------------------------------------


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


# --- the request field ------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 20])
def test_logprobs_field_takes_0_to_20(value: int) -> None:
    for line in ({"prompt": "x", "logprobs": value},
                 {"op": "chat", "messages": [{"role": "user", "content": "x"}],
                  "logprobs": value}):
        request = protocol.decode_request(json.dumps(line).encode())
        assert isinstance(request, GenerateRequest | ChatRequest)
        assert request.logprobs == value


# Strict JSON values (no NaN, no lone surrogates): anything else is bad_json, whatever
# the field (tests/test_property.py sends those).
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


# --- the daemon -----------------------------------------------------------------------

# One slot, drafts of at most 2 tokens: requests compared with each other compute each
# row as a lone row would (tests/test_speculative.py, ONE_SLOT and the exact test).
CONFIG = {"server": {"slots": 1}, "speculative": {"draft_max": 2, "draft_start": 2}}
GREEDY = {"prompt": "The three primary colors are", "max_tokens": 32, "temperature": 0,
          "cache_prompt": False}
RECORD = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
COPY = {"op": "chat",
        "messages": [{"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}],
        "max_tokens": 48, "temperature": 0, "cache_prompt": False}
daemon_test = pytest.mark.asyncio


def check_entries(entries: list[dict[str, Any]], top: int, greedy: bool = True) -> None:
    for entry in entries:
        assert set(entry) == {"token", "text", "bytes", "logprob", "top_logprobs"}
        assert entry["logprob"] <= 0
        assert entry["text"] == bytes(entry["bytes"]).decode("utf-8", "replace")
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == top
        values = [alternative["logprob"] for alternative in alternatives]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
        for alternative in alternatives:
            assert alternative["text"] == bytes(alternative["bytes"]).decode("utf-8", "replace")
        if greedy and top:
            assert alternatives[0]["token"] == entry["token"]
            assert alternatives[0]["logprob"] == entry["logprob"]
            assert alternatives[0]["bytes"] == entry["bytes"]


def joined(entries: list[dict[str, Any]]) -> bytes:
    return b"".join(bytes(entry["bytes"]) for entry in entries)


async def whole(client: Client, request: dict[str, Any]) -> dict[str, Any]:
    return done_of(await client.request({**request, "stream": False}, timeout=120))


@daemon_test
async def test_greedy_entries_match_the_text_streamed_or_not() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**GREEDY, "logprobs": 5})
        entries = done["logprobs"]
        check_entries(entries, 5)
        assert len(entries) == done["usage"]["completion_tokens"] == 32
        assert joined(entries) == done["text"].encode()
        lines = await client.request({**GREEDY, "logprobs": 5, "stream": True}, timeout=120)
        tokens = [line for line in lines if line["type"] == "token"]
        assert all(set(line) == {"id", "type", "text", "logprobs"} for line in tokens)
        # Without holdback (no stop, whole characters) each line carries its own token.
        assert all(joined(line["logprobs"]) == line["text"].encode() for line in tokens)
        streamed = [entry for line in tokens for entry in line["logprobs"]]
        assert done_of(lines)["logprobs"] == []
        assert [e["token"] for e in streamed] == [e["token"] for e in entries]
        for one, other in zip(streamed, entries, strict=True):
            assert one["logprob"] == pytest.approx(other["logprob"], abs=1e-4)
        # Asked for none: no key anywhere.
        plain = await client.request({**GREEDY, "stream": True}, timeout=120)
        assert all("logprobs" not in line for line in plain)
        assert "logprobs" not in await whole(client, GREEDY)


@daemon_test
async def test_chat_with_logprobs_0_has_no_alternatives() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**COPY, "logprobs": 0, "speculative": False})
        entries = done["logprobs"]
        check_entries(entries, 0)
        assert len(entries) == done["usage"]["completion_tokens"] > 0
        assert joined(entries) == done["text"].encode()
        sampled = await whole(client, {**COPY, "logprobs": 20, "temperature": 0.8, "seed": 3})
        check_entries(sampled["logprobs"], 20, greedy=False)


@daemon_test
async def test_drafted_tokens_carry_the_numbers_of_the_rows_that_verified_them() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        plain = await whole(client, {**COPY, "logprobs": 3, "speculative": False})
        fast = await whole(client, {**COPY, "logprobs": 3})
        assert plain["usage"]["drafted_tokens"] == 0
        assert fast["usage"]["accepted_tokens"] > 0
        assert fast["text"] == plain["text"]
        check_entries(fast["logprobs"], 3)
        for one, other in zip(fast["logprobs"], plain["logprobs"], strict=True):
            assert one["token"] == other["token"]
            assert one["logprob"] == pytest.approx(other["logprob"], abs=1e-3)
            assert [a["token"] for a in one["top_logprobs"]] == [
                a["token"] for a in other["top_logprobs"]]


@daemon_test
async def test_a_stop_sequence_keeps_the_entries_of_the_text_before_it() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        full = await whole(client, {**GREEDY, "logprobs": 1})
        text = full["text"]
        # A stop sequence that first occurs in the middle of the text.
        middle_first = sorted(range(1, len(text) - 3), key=lambda at: abs(at - len(text) // 2))
        stop = next(text[at:at + 3] for at in middle_first
                    if text.find(text[at:at + 3]) == at and text[at:at + 3].strip())
        cut = await whole(client, {**GREEDY, "logprobs": 1, "stop": stop})
        assert cut["finish_reason"] == "stop_sequence"
        assert cut["text"] == text[:text.find(stop)]
        entries = cut["logprobs"]
        assert 0 < len(entries) <= cut["usage"]["completion_tokens"]
        assert [e["token"] for e in entries] == [e["token"] for e in full["logprobs"]][
            :len(entries)]
        # Each entry's token starts before the cut: the last one's text does too.
        assert joined(entries).startswith(cut["text"].encode())
        assert len(joined(entries[:-1])) < len(cut["text"].encode())


@daemon_test
async def test_out_of_range_logprobs_are_invalid_and_the_daemon_serves_on() -> None:
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        for value in (21, -1, "x", 2.5, True):
            for request in (GREEDY, COPY):
                reply = await client.final({**request, "id": "bad", "logprobs": value})
                assert reply["type"] == "error" and reply["code"] == "invalid_request", reply
                assert "$.logprobs" in reply["message"] and reply["id"] == "bad"
        done = await whole(client, {**GREEDY, "max_tokens": 4, "logprobs": 20})
        check_entries(done["logprobs"], 20)
        assert len(done["logprobs"]) == 4


@daemon_test
async def test_a_grammar_request_reports_the_models_own_numbers() -> None:
    # Before the grammar's mask: a token it forced may be unlikely, but every number is
    # the model's, and the entries still cover the whole reply.
    async with running_daemon(CONFIG) as daemon, daemon.client() as client:
        done = await whole(client, {**COPY, "format": "json", "logprobs": 2})
        json.loads(done["text"])
        entries = done["logprobs"]
        check_entries(entries, 2, greedy=False)
        assert len(entries) == done["usage"]["completion_tokens"]
        assert joined(entries) == done["text"].encode()
