"""Faults over a real socket: every class of bad input, hostile framing, many and
misbehaving clients. After each, the daemon must still answer a NEW connection.

What test_errors.py / test_disconnect.py already cover on one connection is not
repeated here; these tests add the hostile variants (endless lines, 10 MB lines,
deep nesting, one byte at a time, floods, clients that never read or vanish during
prefill) and check that the daemon survives each one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.kit import (
    FINAL_TYPES,
    Daemon,
    RawResult,
    connect_raw,
    done_of,
    parse_reply_lines,
    raw_exchange,
    read_to_end,
    running_daemon,
)
from tests.kit.faults import assert_serves, health, poll_until, rss_anon_mb, vm_rss_mb

pytestmark = pytest.mark.asyncio

# Runs for a long time (seeded; the default model does not stop early on it).
LONG = {"prompt": "Write a very long story about a lighthouse keeper.", "temperature": 0.8,
        "seed": 1}
# ~3000 prompt tokens: seconds of prefill on 2 CPUs.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 300


def line(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def finals(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replies if r["type"] in FINAL_TYPES]


# --- every bad-input class, each on a fresh connection -----------------------------------

DEEP = 100_000

# (case, line, accepted codes). Every one is answered and the connection stays open.
BAD_JSON_CASES: list[tuple[str, bytes, set[str]]] = [
    ("nan", b'{"prompt": "x", "temperature": NaN}\n', {"bad_json"}),
    ("infinity", b'{"prompt": "x", "top_p": Infinity}\n', {"bad_json"}),
    ("minus-infinity", b'{"prompt": "x", "temperature": -Infinity}\n', {"bad_json"}),
    ("invalid-utf8", b'{"prompt": "\xc3\x28 broken"}\n', {"bad_json"}),
    ("overlong-utf8", b'{"prompt": "\xc0\xaf"}\n', {"bad_json"}),
    ("utf8-encoded-surrogate", b'{"prompt": "\xed\xa0\x80"}\n', {"bad_json"}),
    ("lone-high-surrogate", b'{"prompt": "\\ud800"}\n', {"bad_json"}),
    ("lone-low-surrogate", b'{"prompt": "a\\udc00b"}\n', {"bad_json"}),
    ("surrogate-in-id", b'{"op": "health", "id": "\\ud800"}\n', {"bad_json"}),
    ("array", b"[]\n", {"bad_json"}),
    ("string", b'"health"\n', {"bad_json"}),
    ("number", b"42\n", {"bad_json"}),
    ("null", b"null\n", {"bad_json"}),
    ("true", b"true\n", {"bad_json"}),
    ("truncated", b'{"op": "health"\n', {"bad_json"}),
    ("trailing-garbage", b'{"op": "health"} {}\n', {"bad_json"}),
    ("nul-byte", b'{"op": "health"}\x00\n', {"bad_json"}),
    ("single-quotes", b"{'op': 'health'}\n", {"bad_json"}),
    ("deep-open-arrays", b"[" * DEEP + b"\n", {"bad_json"}),
    ("deep-closed-arrays", b"[" * DEEP + b"]" * DEEP + b"\n", {"bad_json"}),
    ("deep-open-in-field", b'{"prompt": "x", "stop": ' + b"[" * DEEP + b"\n", {"bad_json"}),
    # Well-formed but absurdly deep: either code is a fair answer.
    ("deep-closed-in-unknown-field",
     b'{"op": "health", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}\n",
     {"bad_json", "invalid_request"}),
    ("deep-objects", b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"\n",
     {"bad_json", "invalid_request"}),
]

# (case, request, text the message must contain). The error echoes the request's id.
INVALID_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-op", {"op": "explode"}, "$.op"),
    ("op-not-a-string", {"op": 7}, "$.op"),
    ("unknown-field", {"prompt": "hi", "max_tokenz": 3}, "max_tokenz"),
    ("unknown-field-on-health", {"op": "health", "verbose": True}, "verbose"),
    ("prompt-on-health", {"op": "health", "prompt": "x"}, "prompt"),
    ("missing-prompt", {"max_tokens": 3}, "prompt"),
    ("empty-prompt", {"prompt": ""}, "$.prompt"),
    ("prompt-int", {"prompt": 5}, "$.prompt"),
    ("prompt-null", {"prompt": None}, "$.prompt"),
    ("stream-string", {"prompt": "hi", "stream": "yes"}, "$.stream"),
    ("max_tokens-float", {"prompt": "hi", "max_tokens": 1.5}, "$.max_tokens"),
    ("max_tokens-bool", {"prompt": "hi", "max_tokens": True}, "$.max_tokens"),
    ("max_tokens-zero", {"prompt": "hi", "max_tokens": 0}, "$.max_tokens"),
    ("max_tokens-negative", {"prompt": "hi", "max_tokens": -1}, "$.max_tokens"),
    ("temperature-negative", {"prompt": "hi", "temperature": -0.1}, "$.temperature"),
    ("temperature-string", {"prompt": "hi", "temperature": "hot"}, "$.temperature"),
    ("top_k-negative", {"prompt": "hi", "top_k": -1}, "$.top_k"),
    ("top_p-zero", {"prompt": "hi", "top_p": 0}, "$.top_p"),
    ("top_p-above-one", {"prompt": "hi", "top_p": 1.01}, "$.top_p"),
    ("min_p-negative", {"prompt": "hi", "min_p": -0.5}, "$.min_p"),
    ("min_p-above-one", {"prompt": "hi", "min_p": 2}, "$.min_p"),
    ("repeat_penalty-zero", {"prompt": "hi", "repeat_penalty": 0}, "$.repeat_penalty"),
    ("seed-negative", {"prompt": "hi", "seed": -1}, "$.seed"),
    ("seed-float", {"prompt": "hi", "seed": 1.5}, "$.seed"),
    ("cache_prompt-int", {"prompt": "hi", "cache_prompt": 1}, "$.cache_prompt"),
    ("stop-int", {"prompt": "hi", "stop": 5}, "$.stop"),
    ("stop-list-of-int", {"prompt": "hi", "stop": [1]}, "$.stop"),
    ("stop-empty-string", {"prompt": "hi", "stop": ""}, "$.stop"),
    ("stop-list-with-empty", {"prompt": "hi", "stop": ["ok", ""]}, "$.stop"),
    ("stop-nine", {"prompt": "hi", "stop": [f"s{i}" for i in range(9)]}, "$.stop"),
    ("chat-no-messages", {"op": "chat", "messages": []}, "$.messages"),
    ("chat-bad-role", {"op": "chat", "messages": [{"role": "god", "content": "x"}]}, "role"),
    ("chat-content-int", {"op": "chat", "messages": [{"role": "user", "content": 1}]},
     "content"),
    ("tokenize-no-text", {"op": "tokenize"}, "text"),
    ("detokenize-negative", {"op": "detokenize", "tokens": [-1]}, "$.tokens"),
    ("detokenize-outside-vocab", {"op": "detokenize", "tokens": [2, 1_000_000_000]},
     "tokens"),
    ("cancel-no-target", {"op": "cancel"}, "target"),
    ("cancel-target-list", {"op": "cancel", "target": [1]}, "$.target"),
]

# An id that is not a string or an int: invalid, answered with an assigned id.
BAD_ID_CASES: list[tuple[str, bytes]] = [
    ("id-float", b'{"op": "health", "id": 1.5}\n'),
    ("id-bool", b'{"op": "health", "id": true}\n'),
    ("id-list", b'{"op": "health", "id": [1]}\n'),
    ("id-object", b'{"op": "health", "id": {"a": 1}}\n'),
]


async def _one_line_on_a_new_connection(daemon: Daemon, data: bytes) -> list[dict[str, Any]]:
    """Send one line on a fresh connection, half-close, read every reply to EOF."""
    result = await asyncio.to_thread(raw_exchange, daemon.socket_path, [data],
                                     half_close=True, timeout=60)
    assert result.ended in ("eof", "reset"), result
    return result.lines()


async def test_every_bad_json_class_is_answered_and_the_daemon_survives() -> None:
    failures = []
    async with running_daemon() as daemon:
        for case, data, codes in BAD_JSON_CASES:
            replies = await _one_line_on_a_new_connection(daemon, data)
            if (len(replies) != 1 or replies[0]["type"] != "error"
                    or replies[0]["code"] not in codes or not replies[0]["message"]):
                failures.append((case, replies))
            await assert_serves(daemon)
    assert not failures, failures


async def test_every_invalid_request_class_names_the_field_and_keeps_the_id() -> None:
    failures = []
    async with running_daemon() as daemon:
        for number, (case, request, mentions) in enumerate(INVALID_CASES):
            request_id = f"bad-{number}" if number % 2 else number  # str and int ids
            replies = await _one_line_on_a_new_connection(daemon, line({"id": request_id,
                                                                        **request}))
            if (len(replies) != 1 or replies[0]["type"] != "error"
                    or replies[0]["code"] != "invalid_request"
                    or replies[0]["id"] != request_id or mentions not in replies[0]["message"]):
                failures.append((case, replies))
            await assert_serves(daemon)
        for case, data in BAD_ID_CASES:
            replies = await _one_line_on_a_new_connection(daemon, data)
            if (len(replies) != 1 or replies[0].get("code") != "invalid_request"
                    or not str(replies[0]["id"]).startswith("sfc-")
                    or "$.id" not in replies[0]["message"]):
                failures.append((case, replies))
            await assert_serves(daemon)
    assert not failures, failures


async def test_context_overflow_generate_and_chat() -> None:
    async with running_daemon({"model": {"n_ctx": 256}}) as daemon:
        async with daemon.client() as client:
            error = await client.final({"id": "big", "prompt": "word " * 600})
            assert error["type"] == "error" and error["code"] == "context_overflow", error
            assert error["id"] == "big"
            error = await client.final({"id": "big-chat", "op": "chat", "messages": [
                {"role": "user", "content": "word " * 600}]})
            assert error["type"] == "error" and error["code"] == "context_overflow", error
            # A prompt that leaves room for one token is served, clipped to the room left.
            tokens = (await client.final({"op": "tokenize", "text": "word " * 600}))["tokens"]
            text = (await client.final({"op": "detokenize", "tokens": tokens[1:255]}))["text"]
            fits = (await client.final({"op": "tokenize", "text": text}))["tokens"]
            assert len(fits) < 256
            done = done_of(await client.request({"prompt": text, "max_tokens": 500,
                                                 "temperature": 0}))
            assert done["usage"]["prompt_tokens"] == len(fits)
            assert done["usage"]["completion_tokens"] <= 256 - len(fits)
        await assert_serves(daemon)


async def test_queue_full_with_a_small_max_queue() -> None:
    async with running_daemon({"server": {"max_queue": 2, "slots": 1}}) as daemon:
        runner = await daemon.connect()
        await runner.start_streaming({"id": "run", **LONG, "max_tokens": 2000})
        waiters = [await daemon.connect() for _ in range(2)]
        for number, waiter in enumerate(waiters, 1):
            await waiter.send({"id": f"wait-{number}", "prompt": "Hello", "max_tokens": 2})
            await poll_until(lambda: health(daemon), lambda h, n=number: h["queue_depth"] == n,
                             timeout=30, what=f"queue depth {number}")
        async with daemon.client() as extra:
            error = await extra.final({"id": "over", "prompt": "Hi", "max_tokens": 2})
            assert error["code"] == "queue_full" and error["id"] == "over", error
            # Not an error for the other ops.
            assert (await extra.final({"op": "health"}))["queue_depth"] == 2
        await runner.close()  # frees the slot: the queued ones run
        for number, waiter in enumerate(waiters, 1):
            done = done_of(await waiter.reply())
            assert done["id"] == f"wait-{number}"
            await waiter.close()
        await assert_serves(daemon)


async def test_too_many_connections_with_a_small_max_connections() -> None:
    async with running_daemon({"server": {"max_connections": 3}}) as daemon:
        admitted = [await daemon.connect() for _ in range(3)]
        for client in admitted:
            assert (await client.final({"op": "health"}))["status"] == "ok"
        # The refused client's request, sent at once, must never run.
        refused = await asyncio.to_thread(
            raw_exchange, daemon.socket_path,
            [line({"id": "sneak", "prompt": "Hello", "max_tokens": 200})], timeout=30)
        codes = [r.get("code") for r in refused.lines()]
        assert codes == ["too_many_connections"], refused
        assert refused.ended in ("eof", "reset")
        health_reply = await admitted[0].final({"op": "health"})
        assert health_reply["busy"] is False and health_reply["queue_depth"] == 0
        await admitted.pop().close()

        # Once one leaves, a new connection is admitted (the daemon notices the close
        # asynchronously, so a refusal in between is retried, boundedly).
        async def try_connect() -> list[dict[str, Any]]:
            result = await asyncio.to_thread(
                raw_exchange, daemon.socket_path, [line({"op": "health"})],
                half_close=True, timeout=30)
            return result.lines()

        replies = await poll_until(try_connect, lambda r: r[0]["type"] == "health",
                                   timeout=5, what="a connection admitted again")
        assert replies[0]["status"] == "ok"
        for client in admitted:
            await client.close()
        await assert_serves(daemon)


# --- framing -------------------------------------------------------------------------------


async def test_endless_line_without_newline_is_cut_at_the_limit() -> None:
    limit = 4096
    async with running_daemon({"server": {"max_line_bytes": limit}}) as daemon:
        # A valid request, then a line that never ends: the daemon must answer
        # line_too_long and close without waiting for a newline that never comes.
        chunks = [line({"id": "before", "op": "health"}), b'{"prompt": "']
        chunks += [b"x" * 1024] * 64  # 16 x the limit, and the socket stays open
        result = await asyncio.to_thread(raw_exchange, daemon.socket_path, chunks, timeout=30)
        assert result.ended in ("eof", "reset"), f"the daemon did not close: {result}"
        replies = result.lines()
        assert [r["type"] for r in replies] == ["health", "error"], replies
        assert replies[0]["id"] == "before"
        assert replies[1]["code"] == "line_too_long"
        await assert_serves(daemon)


async def test_nothing_after_the_cut_is_executed() -> None:
    limit = 4096
    async with running_daemon({"server": {"max_line_bytes": limit}}) as daemon:
        after = line({"id": "after", "prompt": "Hello", "max_tokens": 200})
        chunks = [b'{"prompt": "' + b"y" * (3 * limit), b'"}\n' + after + after,
                  line({"id": "after-health", "op": "health"})]
        result = await asyncio.to_thread(raw_exchange, daemon.socket_path, chunks, timeout=30)
        replies = result.lines()
        assert [r.get("code") for r in replies] == ["line_too_long"], replies
        assert result.ended in ("eof", "reset")
        health_reply = await health(daemon)
        assert health_reply["busy"] is False and health_reply["queue_depth"] == 0
        async with daemon.client() as client:
            stats = await client.final({"op": "stats"})
            assert stats["requests"]["by_op"]["generate"] == 0, stats
            assert stats["requests"]["by_op"]["health"] == 1, stats  # ours, just above
        await assert_serves(daemon)


async def test_a_ten_megabyte_line_with_the_default_limit() -> None:
    async with running_daemon() as daemon:  # max_line_bytes: 1 MiB by default
        pid = daemon.process.pid
        await assert_serves(daemon)
        before = rss_anon_mb(pid)
        size = 10 * 1024 * 1024
        chunks = [b'{"prompt": "'] + [b"z" * 65536] * (size // 65536) + [b'"}\n']
        result = await asyncio.to_thread(raw_exchange, daemon.socket_path, chunks, timeout=60)
        assert [r.get("code") for r in result.lines()] == ["line_too_long"], result
        assert result.ended in ("eof", "reset")
        # The daemon stopped reading at the limit: it never held the 10 MB.
        assert result.send_error is not None, "the daemon read all 10 MB"
        assert rss_anon_mb(pid) - before < 16, (before, rss_anon_mb(pid))
        await assert_serves(daemon)


async def test_a_request_sent_one_byte_at_a_time() -> None:
    async with running_daemon() as daemon:
        data = (line({"id": "h", "op": "health"})
                + json.dumps({"id": "g", "prompt": "Grüße, 日本 🌍", "max_tokens": 2},
                             ensure_ascii=False).encode() + b"\n")
        # Paced so the pieces arrive as separate reads, UTF-8 characters split included.
        result = await asyncio.to_thread(
            raw_exchange, daemon.socket_path, [bytes([b]) for b in data], pace_s=0.002,
            half_close=True, timeout=60)
        replies = result.lines()
        assert [r["id"] for r in finals(replies)] == ["h", "g"], replies
        done = finals(replies)[1]
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 2, done
        await assert_serves(daemon)


async def test_many_requests_in_one_write_are_all_answered_in_order() -> None:
    requests: list[bytes] = []
    expected: list[tuple[Any, str]] = []  # (id or None when assigned, type or error code)
    for number in range(300):
        kind = number % 6
        if kind == 0:
            requests.append(line({"id": number, "op": "health"}))
            expected.append((number, "health"))
        elif kind == 1:
            requests.append(b"{not json\n")
            expected.append((None, "bad_json"))
        elif kind == 2:
            requests.append(line({"id": f"i{number}", "op": "nope"}))
            expected.append((f"i{number}", "invalid_request"))
        elif kind == 3:
            requests.append(b"   \n")  # blank: no reply
        elif kind == 4:
            requests.append(line({"id": f"t{number}", "op": "tokenize", "text": "hi"}))
            expected.append((f"t{number}", "tokens"))
        elif number % 60 == 5:
            requests.append(line({"id": f"g{number}", "prompt": "Hi", "max_tokens": 2}))
            expected.append((f"g{number}", "done"))
        else:
            requests.append(line({"id": f"s{number}", "op": "stats"}))
            expected.append((f"s{number}", "stats"))
    async with running_daemon() as daemon:
        result = await asyncio.to_thread(raw_exchange, daemon.socket_path, [b"".join(requests)],
                                         half_close=True, timeout=120)
        assert result.ended == "eof", result.ended
        got = [(r["id"], r.get("code", r["type"])) for r in finals(result.lines())]
        assert len(got) == len(expected)
        for (want_id, want), (got_id, kind) in zip(expected, got, strict=True):
            assert kind == want, (want_id, want, got_id, kind)
            if want_id is not None:
                assert got_id == want_id
        await assert_serves(daemon)


async def test_stop_lists_at_their_limits() -> None:
    base = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
    async with running_daemon() as daemon:
        async with daemon.client() as client:
            eight = [f"never-{i}-zq" for i in range(8)]
            done = done_of(await client.request({**base, "stop": eight}))
            assert done["finish_reason"] == "length", done
            for stop in ([*eight, "ninth"], "", [""], ["a", ""]):
                error = await client.final({"id": "s", **base, "stop": stop})
                assert error["type"] == "error" and error["code"] == "invalid_request", (
                    stop, error)
                assert "$.stop" in error["message"]
            # Very long stop strings: allowed, and no slower to check per token.
            huge = [("qz" * 10_000) + str(i) for i in range(8)]
            started = time.monotonic()
            done = done_of(await client.request({**base, "stop": huge}, timeout=60))
            assert done["finish_reason"] == "length"
            assert done["usage"]["completion_tokens"] == 8
            assert time.monotonic() - started < 20
            one_huge = "Hello" * 40_000  # 200 KB, and a prefix of it is likely output
            lines = await client.request({**base, "stop": one_huge}, timeout=60)
            assert done_of(lines)["finish_reason"] in ("length", "stop")
        await assert_serves(daemon)


# --- many clients --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_hundred_simultaneous_connections_are_all_served() -> None:
    config = {"server": {"max_connections": 128, "max_queue": 128}}
    async with running_daemon(config) as daemon:
        clients = await asyncio.gather(*(daemon.connect() for _ in range(100)))
        try:
            healths = await asyncio.gather(*(c.final({"op": "health", "id": n})
                                             for n, c in enumerate(clients)))
            assert [h["id"] for h in healths] == list(range(100))
            assert all(h["status"] == "ok" for h in healths)
            replies = await asyncio.gather(*(
                c.request({"id": f"g{n}", "prompt": "Hi", "max_tokens": 2}, timeout=180)
                for n, c in enumerate(clients)))
            for number, lines in enumerate(replies):
                done = done_of(lines)
                assert done["id"] == f"g{number}"
                assert done["usage"]["completion_tokens"] == 2
            async with daemon.client() as monitor:
                stats = await monitor.final({"op": "stats"})
            assert stats["connections"]["current"] == 101, stats["connections"]
            assert stats["connections"]["rejected"] == 0
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        await assert_serves(daemon)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_eight_concurrent_clients_are_served_in_fifo_order() -> None:
    # One slot, so that all eight queue: tests/e2e/ndjson/test_slots.py has them decoded together.
    async with running_daemon({"server": {"slots": 1}}) as daemon:
        clients = [await daemon.connect() for _ in range(8)]
        async with daemon.client() as monitor:
            # Each request is sent only once the previous one is known to be queued, so
            # the daemon's arrival order is 0, 1, ..., 7. Client 0 holds the slot meanwhile.
            await clients[0].start_streaming({"id": "c0", **LONG, "max_tokens": 200})
            for number in range(1, 8):
                await clients[number].send({"id": f"c{number}", "prompt": f"Count to {number}",
                                            "max_tokens": 4})

                async def probe() -> dict[str, Any]:
                    return await monitor.final({"op": "health"})

                await poll_until(probe, lambda h, n=number: h["queue_depth"] == n,
                                 timeout=30, what=f"client {number} queued")
            first_token_at: dict[int, float] = {}

            async def collect(number: int) -> dict[str, Any]:
                lines = []
                while True:
                    reply = await clients[number].recv(timeout=120)
                    assert reply is not None, f"client {number}: EOF"
                    if reply["type"] != "queued":  # where it waited comes at once
                        first_token_at.setdefault(number, time.monotonic())
                    lines.append(reply)
                    if reply["type"] in FINAL_TYPES:
                        return done_of(lines)

            dones = await asyncio.gather(*(collect(n) for n in range(1, 8)))
            assert all(d["finish_reason"] in ("length", "stop") for d in dones)
            order = sorted(first_token_at, key=first_token_at.__getitem__)
            assert order == list(range(1, 8)), order
            assert done_of(await clients[0].reply())["id"] == "c0"
        for client in clients:
            await client.close()
        await assert_serves(daemon)


async def _slot_free(daemon: Daemon) -> None:
    await poll_until(lambda: health(daemon), lambda h: h["busy"] is False,
                     timeout=60, interval=0.02, what="an idle slot")


async def _ubatch_ms(daemon: Daemon) -> float:
    """What evaluating one 512-token ubatch costs on this machine now."""
    async with daemon.client() as client:
        done = done_of(await client.request({"prompt": LONG_PROMPT[:2300], "max_tokens": 1,
                                             "cache_prompt": False}))
    return float(done["timings"]["prompt_ms"])


@pytest.mark.slow
@pytest.mark.parametrize("n_batch", [512, 4096])
async def test_a_client_killed_during_prefill_frees_the_slot_within_a_ubatch(
        n_batch: int) -> None:
    # One slot: the next request runs only once the killed one's prefill has stopped.
    config = {"model": {"n_ctx": 4096, "n_batch": n_batch, "n_ubatch": 512},
              "server": {"slots": 1}}
    async with running_daemon(config) as daemon:
        ubatch = await _ubatch_ms(daemon)
        leaver = connect_raw(daemon.socket_path, 30)
        try:
            leaver.sendall(line({"id": "long-prompt", "prompt": LONG_PROMPT, "max_tokens": 50}))
            await poll_until(lambda: health(daemon), lambda h: h["busy"] is True,
                             timeout=30, what="the long prompt in the slot")
            leaver.setblocking(False)
            with pytest.raises(BlockingIOError):
                leaver.recv(1)  # nothing streamed yet: still in prefill
        finally:
            leaver.close()
        async with daemon.client() as client:
            done = done_of(await client.request({"prompt": "Hello", "max_tokens": 2}))
        # The ~3300-token prompt (about 7 ubatches) stopped within about one.
        assert done["timings"]["queued_ms"] < 3 * ubatch, (ubatch, done["timings"])
        await assert_serves(daemon)


@pytest.mark.slow
async def test_a_client_killed_during_decode_frees_the_slot() -> None:
    async with running_daemon() as daemon:
        leaver = await daemon.connect()
        await leaver.start_streaming({"id": "long", **LONG, "max_tokens": 2000})
        await leaver.close()
        await _slot_free(daemon)
        async with daemon.client() as client:
            stats = await client.final({"op": "stats"})
        # Stopped, not run to its 2000 tokens.
        assert stats["requests"]["by_outcome"]["cancelled"] == 1, stats["requests"]
        assert stats["tokens"]["generated"] < 1000, stats["tokens"]
        await assert_serves(daemon)


def _flood_without_reading(path: str, first: bytes, filler: bytes, cap_bytes: int,
                           timeout: float) -> tuple[int, str | None, bytes, str]:
    """Send `first`, then `filler` over and over without ever reading, until the daemon
    closes (the send fails), `cap_bytes` were sent, or a send blocks for `timeout`.
    Then read what the daemon had sent. Returns (sent, send error, data, how it ended)."""
    sock = connect_raw(path, timeout)
    sent, error = 0, None
    try:
        sock.sendall(first)
        while sent < cap_bytes:
            try:
                sock.sendall(filler)
            except (BrokenPipeError, ConnectionResetError) as exc:
                error = type(exc).__name__
                break
            except TimeoutError:
                error = "timeout"
                break
            sent += len(filler)
        sock.settimeout(10)
        data, ended = read_to_end(sock)
    finally:
        sock.close()
    return sent, error, data, ended


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["small replies", "large replies"])
async def test_a_client_that_never_reads_is_dropped_and_others_are_served(kind: str) -> None:
    # Replies that are answered at once (nothing running ahead of them), so the unread
    # output can only grow: past the kernel's socket buffer it piles up in the daemon,
    # which must drop the client at max_output_buffer_bytes. (A streamed generation is
    # test_disconnect's case; its output may fit in the kernel's buffer altogether.)
    limit = 16 * 1024
    async with running_daemon({"server": {"max_output_buffer_bytes": limit}}) as daemon:
        pid = daemon.process.pid
        await assert_serves(daemon)
        before = rss_anon_mb(pid)
        if kind == "small replies":
            filler = line({"op": "health"}) * 256
        else:  # ~20,000 tokens per reply
            filler = line({"op": "tokenize", "text": "a " * 20_000})
        flood = asyncio.ensure_future(asyncio.to_thread(
            _flood_without_reading, daemon.socket_path, b"", filler, 256 << 20, 30))
        # Others keep being served meanwhile.
        async with daemon.client() as client:
            for number in range(4):
                done = done_of(await client.request(
                    {"id": number, "prompt": "Hello", "max_tokens": 4}, timeout=60))
                assert done["usage"]["completion_tokens"] == 4
        sent, error, data, _ended = await asyncio.wait_for(flood, 90)
        assert error in ("BrokenPipeError", "ConnectionResetError"), (
            f"the daemon neither dropped the client nor kept reading: {error}, {sent} bytes")
        # What it got before the cut: whole reply lines, and far fewer than it asked for.
        complete = data[:data.rfind(b"\n") + 1]
        replies = parse_reply_lines(complete)
        assert all(r["type"] in ("health", "tokens") for r in replies)
        assert len(replies) < sent // len(filler) * filler.count(b"\n")
        assert rss_anon_mb(pid) - before < 50
        await assert_serves(daemon)


@dataclass
class _Flood:
    sock: socket.socket
    kinds: list[tuple[str, Any]] = field(default_factory=list)  # one per complete line sent
    unsent: bytes = b""  # the rest of the line that was partly sent when time ran out
    sent_bytes: int = 0


def _flood_lines(number: int) -> tuple[bytes, tuple[str, Any] | None]:
    kind = number % 8
    if kind in (0, 4):
        return b'{"op":"health"}\n', ("health", None)
    if kind == 1:
        return b'{"op":"health","id":' + str(number).encode() + b"}\n", ("health", number)
    if kind == 2:
        return b"{bad json\n", ("bad_json", None)
    if kind == 3:
        return b"\n", None  # blank: no reply
    if kind == 5:
        return (b'{"op":"nope","id":"n' + str(number).encode() + b'"}\n',
                ("invalid_request", f"n{number}"))
    if kind == 6 and number % 400 == 6:
        return (b'{"id":"g' + str(number).encode() + b'","prompt":"Hi","max_tokens":1}\n',
                ("generate", f"g{number}"))
    return b'[1,2,3]\n', ("bad_json", None)


def _pipeline_without_reading(path: str, head: bytes, seconds: float,
                              tick: Callable[[], None]) -> _Flood:
    """Write `head`, then small requests and bad lines as fast as the daemon takes them,
    never reading, for `seconds`. Only whole lines count as sent; the line cut by the
    deadline is kept in `unsent` to be finished later."""
    sock = connect_raw(path, 30)
    flood = _Flood(sock, [("generate", "long")])
    sock.sendall(head)
    sock.settimeout(0.05)
    pending = bytearray()
    ends: list[tuple[int, tuple[str, Any] | None]] = []  # (end offset in stream, kind)
    offset = 0  # bytes of filler sent so far
    produced = 0
    number = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while len(pending) < 65536:
            data, kind = _flood_lines(number)
            number += 1
            pending += data
            produced += len(data)
            ends.append((produced, kind))
        try:
            count = sock.send(pending[:65536])
        except TimeoutError:
            tick()
            continue
        del pending[:count]
        offset += count
        tick()
    sock.settimeout(60)
    for end, kind in ends:
        if end > offset:
            # The first line not wholly sent: its tail must follow, then nothing more.
            flood.unsent = bytes(pending[:end - offset])
            if kind is not None:
                flood.kinds.append(kind)
            break
        if kind is not None:
            flood.kinds.append(kind)
    flood.sent_bytes = offset
    return flood


def _finish_and_read(flood: _Flood) -> tuple[bytes, str]:
    """Read again: finish the cut line, half-close, and read every reply to EOF."""
    result: dict[str, Any] = {}

    def receive() -> None:
        result["data"], result["ended"] = read_to_end(flood.sock)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    try:
        flood.sock.sendall(flood.unsent)
        flood.sock.shutdown(socket.SHUT_WR)
        receiver.join(120)
        assert not receiver.is_alive(), "replies did not end"
    finally:
        flood.sock.close()
    return result["data"], result["ended"]


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_pipelining_flood_keeps_memory_flat_and_every_read_request_is_answered(
) -> None:
    bound_mb = 50
    # One slot, held by a request that ends only when cancelled (its grammar never
    # completes): the flood's first request waits behind it for as long as the flood
    # lasts, so everything pipelined after it is held, whatever the machine's speed.
    async with running_daemon({"server": {"slots": 1}}) as daemon:
        pid = daemon.process.pid
        await assert_serves(daemon)
        blocker = await daemon.connect()
        # Not speculating: drafts would touch more rows of llama.cpp's logits buffer
        # during the flood (a bounded growth of its own, see test_soak), and would
        # bring the 3000-token end nearer.
        await blocker.start_streaming({"id": "blocker", **LONG, "max_tokens": 3000,
                                       "grammar": "root ::= [a-z ] root",
                                       "speculative": False})
        head = line({"id": "long", **LONG, "max_tokens": 16})
        samples: list[tuple[float, float]] = []
        last_sample = [0.0]

        def tick() -> None:  # sampling, not synchronisation: the flood is the thread's loop
            now = time.monotonic()
            if now - last_sample[0] >= 0.05:
                last_sample[0] = now
                samples.append((rss_anon_mb(pid), vm_rss_mb(pid)))

        baseline = (rss_anon_mb(pid), vm_rss_mb(pid))
        flood = await asyncio.to_thread(_pipeline_without_reading, daemon.socket_path, head,
                                        3.0, tick)
        try:
            samples.append((rss_anon_mb(pid), vm_rss_mb(pid)))
            peak_anon = max(s[0] for s in samples)
            peak_rss = max(s[1] for s in samples)
            print(f"flood: {len(flood.kinds)} requests, {flood.sent_bytes} bytes accepted; "
                  f"RssAnon {baseline[0]:.1f} -> peak {peak_anon:.1f} MB, "
                  f"VmRSS {baseline[1]:.1f} -> peak {peak_rss:.1f} MB")
            assert peak_anon - baseline[0] < bound_mb, (baseline, peak_anon)
            # The head of the line is still waiting behind the blocker.
            assert (await health(daemon))["queue_depth"] >= 1
            await blocker.send({"op": "cancel", "target": "blocker"})
            assert done_of(await blocker.reply())["finish_reason"] == "cancelled"
        except BaseException:
            flood.sock.close()
            raise
        finally:
            await blocker.close()
        data, ended = await asyncio.to_thread(_finish_and_read, flood)
        assert ended == "eof", ended
        got = finals(parse_reply_lines(data))
        assert len(got) == len(flood.kinds), (len(got), len(flood.kinds))
        for reply, (kind, request_id) in zip(got, flood.kinds, strict=True):
            if kind == "generate":
                assert reply["type"] == "done" or reply.get("code") == "queue_full", reply
            elif kind == "health":
                assert reply["type"] == "health", reply
            else:
                assert reply.get("code") == kind, (kind, reply)
            if request_id is not None:
                assert reply["id"] == request_id, (request_id, reply)
        assert got[0]["id"] == "long" and got[0]["type"] == "done"
        await assert_serves(daemon)


# --- idle connections ----------------------------------------------------------------------


async def _closed_after(path: str, data: bytes) -> tuple[float, RawResult]:
    started = time.monotonic()
    result = await asyncio.to_thread(raw_exchange, path, [data] if data else [], timeout=15)
    return time.monotonic() - started, result


@pytest.mark.parametrize("sent", [b"", b'{"op": "hea'], ids=["nothing", "half a line"])
async def test_an_idle_connection_is_closed_after_idle_timeout(sent: bytes) -> None:
    async with running_daemon({"server": {"idle_timeout_s": 1}}) as daemon:
        elapsed, result = await _closed_after(daemon.socket_path, sent)
        assert result.ended in ("eof", "reset"), f"still open after {elapsed:.1f} s"
        assert 0.9 <= elapsed < 5, elapsed
        assert b"health" not in result.data  # the half line was never run
        await assert_serves(daemon)


@pytest.mark.slow
async def test_a_connection_with_a_request_in_flight_is_not_idle() -> None:
    async with running_daemon({"server": {"idle_timeout_s": 1, "slots": 1}}) as daemon:
        async with daemon.client() as runner:
            # One runs and one waits in the queue behind it for several idle timeouts.
            # The runner's grammar never completes: it ends only when cancelled.
            await runner.start_streaming({"id": "run", **LONG, "max_tokens": 100_000,
                                          "grammar": "root ::= [a-z ] root"})
            # Connected only now, and its request sent at once: a connection opened
            # before the runner's prompt was read could sit idle past 1 s on a loaded
            # machine and rightly be closed.
            waiter = await daemon.connect()
            await waiter.send({"id": "wait", "prompt": "Hello", "max_tokens": 2})
            await asyncio.sleep(3)  # the span under test: three idle timeouts
            await runner.send({"op": "cancel", "target": "run"})
            done = done_of(await runner.reply(timeout=60))
            assert done["finish_reason"] == "cancelled", done
            assert done["timings"]["total_ms"] > 3000
            assert (await runner.recv(60) or {}).get("type") == "cancelled"
            waited = done_of(await waiter.reply(timeout=60))
            assert waited["timings"]["queued_ms"] > 3000, waited["timings"]
            # Idle again once answered: closed about a second later.
            started = time.monotonic()
            await runner.expect_eof(timeout=10)
            assert time.monotonic() - started < 5
            await waiter.close()
        await assert_serves(daemon)
