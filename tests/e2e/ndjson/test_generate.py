"""Generation semantics through the real daemon, socket and default model."""

from __future__ import annotations

import pytest

from tests.kit import done_of, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

README_REQUEST = {"prompt": "Jelaskan Rust dalam 1 kalimat", "stream": True, "max_tokens": 100}


async def test_readme_request_streams_tokens_then_done() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        lines = await client.request(README_REQUEST)
        done = done_of(lines)
        tokens = [line for line in lines if line["type"] == "token"]
        assert tokens, lines
        assert all(set(t) == {"id", "type", "text"} and t["text"] for t in tokens)
        assert len({line["id"] for line in lines}) == 1
        assert done["text"] == ""  # streamed: the text came in the token lines
        assert done["finish_reason"] in {"stop", "length"}
        assert done["stop_sequence"] is None
        usage = done["usage"]
        assert usage["prompt_tokens"] > 0
        assert 0 < usage["completion_tokens"] <= 100
        assert usage["completion_tokens"] >= len(tokens)
        if done["finish_reason"] == "length":
            assert usage["completion_tokens"] == 100
        timings = done["timings"]
        assert timings.pop("cache_source") in ("none", "slot")
        assert set(timings) == {"queued_ms", "prompt_ms", "prompt_tok_s", "first_token_ms",
                                "decode_ms", "decode_tok_s", "total_ms"}
        assert all(isinstance(v, float) and v >= 0 for v in timings.values())
        assert timings["first_token_ms"] <= timings["total_ms"]
        assert timings["queued_ms"] + timings["prompt_ms"] <= timings["first_token_ms"] + 1
        assert timings["decode_tok_s"] > 0 and timings["prompt_tok_s"] > 0


async def test_streamed_tokens_equal_non_streamed_text_for_the_same_seed() -> None:
    request = {"prompt": "Write a short poem about the sea.", "max_tokens": 48,
               "temperature": 0.9, "top_k": 50, "top_p": 0.95, "min_p": 0.02,
               "seed": 1234, "cache_prompt": False}
    async with running_daemon() as daemon, daemon.client() as client:
        streamed = await client.request({**request, "stream": True})
        whole = done_of(await client.request({**request, "stream": False}))
        again = done_of(await client.request({**request, "stream": False}))
        assert tokens_text(streamed) == whole["text"] != ""
        assert again["text"] == whole["text"]
        assert done_of(streamed)["usage"] == whole["usage"]


async def test_seed_larger_than_32_bits_is_accepted_and_reproducible() -> None:
    request = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0,
               "seed": 2**63 + 12345, "stream": False, "cache_prompt": False}
    async with running_daemon() as daemon, daemon.client() as client:
        first = done_of(await client.request(request))
        second = done_of(await client.request(request))
        assert first["text"] == second["text"] != ""


async def test_greedy_is_deterministic_and_max_tokens_ends_with_length() -> None:
    request = {"prompt": "Count: 1, 2, 3,", "max_tokens": 12, "temperature": 0,
               "stream": False, "cache_prompt": False}
    async with running_daemon() as daemon, daemon.client() as client:
        first = done_of(await client.request(request))
        second = done_of(await client.request(request))
        assert first["text"] == second["text"]
        assert first["finish_reason"] == "length"
        assert first["usage"]["completion_tokens"] == 12


async def test_end_of_generation_token_ends_with_stop() -> None:
    # The default model is a base model: after a complete JSON object it ends the
    # document (greedy: one newline, then <eos>).
    request = {"prompt": '{"name": "John", "age": 30}', "max_tokens": 64, "temperature": 0,
               "stream": False, "cache_prompt": False}
    async with running_daemon() as daemon, daemon.client() as client:
        done = done_of(await client.request(request))
        assert done["finish_reason"] == "stop", done
        assert done["usage"]["completion_tokens"] < 64
        assert "<eos>" not in done["text"]


async def test_stop_sequences_end_before_their_first_occurrence() -> None:
    base = {"prompt": "The alphabet in order: A B C D E F G H", "max_tokens": 40,
            "temperature": 0, "cache_prompt": False}
    async with running_daemon() as daemon, daemon.client() as client:
        reference = done_of(await client.request({**base, "stream": False}))["text"]
        assert len(reference) > 20, reference
        # A stop that starts mid-output and spans several tokens, plus one that never occurs.
        stop = reference[8:20]
        expected = reference[: reference.find(stop)]
        for stream in (True, False):
            lines = await client.request(
                {**base, "stream": stream, "stop": [stop, "never-appears-here"]})
            done = done_of(lines)
            text = tokens_text(lines) if stream else done["text"]
            assert text == expected
            assert done["finish_reason"] == "stop_sequence"
            assert done["stop_sequence"] == stop
            # Ended where the stop appeared, also unstreamed (whose pieces otherwise wait
            # for the end: Job.wake_each_step), not at max_tokens.
            assert done["usage"]["completion_tokens"] < 40, done
            # No token line carries any part of the matched stop.
            assert all(stop not in line.get("text", "") for line in lines)


async def test_stop_sequence_at_the_very_first_token() -> None:
    base = {"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0,
            "cache_prompt": False, "stream": True}
    async with running_daemon() as daemon, daemon.client() as client:
        reference = tokens_text(await client.request(base))
        lines = await client.request({**base, "stop": reference[:2]})
        assert [line["type"] for line in lines] == ["done"]
        assert lines[0]["finish_reason"] == "stop_sequence"


async def test_generation_defaults_come_from_the_config() -> None:
    config = {"generation": {"max_tokens": 5, "temperature": 0.0}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        first = done_of(await client.request({"prompt": "Hello", "stream": False,
                                              "cache_prompt": False}))
        second = done_of(await client.request({"prompt": "Hello", "stream": False,
                                               "cache_prompt": False}))
        assert first["usage"]["completion_tokens"] == 5
        assert first["text"] == second["text"]  # temperature 0 from the config: greedy


async def test_context_overflow_and_clipping_to_the_room_left() -> None:
    async with running_daemon({"model": {"n_ctx": 256}}) as daemon, daemon.client() as client:
        too_long = await client.final({"id": "big", "prompt": "word " * 400})
        assert too_long["type"] == "error" and too_long["code"] == "context_overflow"
        assert too_long["id"] == "big"
        assert "256" in too_long["message"]
        # The same connection keeps working, and max_tokens is clipped to the room left.
        done = done_of(await client.request(
            {"prompt": "word " * 200, "max_tokens": 10_000, "temperature": 0,
             "stream": False}))
        assert done["finish_reason"] == "length"
        usage = done["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        await client.send(
            {"id": 1, "prompt": "First:", "max_tokens": 8},
            {"id": 2, "op": "health"},
            {"id": 3, "prompt": "Second:", "max_tokens": 4, "stream": False},
            {"id": 4, "prompt": "x", "max_tokens": 0},
            {"id": 5, "op": "health"},
        )
        order = []
        for _ in range(5):
            for line in await client.reply():
                order.append(line["id"])
        # Every line of request 1 comes before anything of request 2, and so on.
        assert order == sorted(order)
        assert set(order) == {1, 2, 3, 4, 5}


async def test_requests_during_model_load_are_served_once_loaded() -> None:
    async with running_daemon(wait_ready=False) as daemon, daemon.client() as client:
        health = await client.final({"op": "health"})
        assert health["status"] == "loading"
        assert health["model"] == ""
        lines = await client.request({"prompt": "Hello", "max_tokens": 3})
        assert done_of(lines)["usage"]["completion_tokens"] == 3
        assert (await daemon.notification("READY=1")).startswith("READY=1")
        assert (await client.final({"op": "health"}))["status"] == "ok"


async def test_health_reports_model_and_state() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        health = await client.final({"op": "health", "id": "h"})
        assert health == {"type": "health", "id": "h", "status": "ok",
                          "model": "Gemma 3 270m", "busy": False, "queue_depth": 0,
                          "uptime_s": health["uptime_s"], "slots": 8, "slots_busy": 0}
        assert health["uptime_s"] > 0
        async with daemon.client() as other:
            await other.start_streaming({"prompt": "Tell me a long story.", "max_tokens": 400})
            busy = await client.final({"op": "health"})
            assert busy["busy"] is True
            assert busy["slots_busy"] == 1
            assert busy["id"].startswith("sfc-")  # assigned when the client gives none
