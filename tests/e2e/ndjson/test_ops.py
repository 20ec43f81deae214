"""tokenize, detokenize, info, stats and cancel against the real daemon and model."""

from __future__ import annotations

import signal

import pytest

from sfcore_daemon import __version__
from tests.kit import done_of, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

LONG = {"prompt": "Write a very long story about a lighthouse keeper.", "max_tokens": 2000,
        "temperature": 0}
ROUND_TRIP_TEXTS = ["媽媽 🤗 e\u0301 n\u0303 a\u0308", "\n", "a\nb", " leading space",
                    "trailing space ", "<start_of_turn>user", "tab\tand\r\nCRLF", ""]


async def test_tokenize_detokenize_round_trip_is_exact() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        for text in ROUND_TRIP_TEXTS:
            tokens = (await client.final({"op": "tokenize", "text": text}))["tokens"]
            assert tokens[0] == 2  # <bos>: add_special defaults to true
            again = await client.final({"op": "detokenize", "tokens": tokens})
            assert again == {"type": "text", "id": again["id"], "text": text}
            bare = (await client.final({"op": "tokenize", "text": text,
                                        "add_special": False}))["tokens"]
            assert bare == tokens[1:]
            assert (await client.final({"op": "detokenize", "tokens": bare}))["text"] == text
        # Special-token text is parsed, as in a generate prompt: one token, not eleven.
        marker = await client.final({"op": "tokenize", "text": "<end_of_turn>",
                                     "add_special": False})
        assert marker["tokens"] == [106]


async def test_tokenize_counts_match_the_prompt_tokens_of_generate() -> None:
    prompt = "Jelaskan Rust dalam 1 kalimat"
    async with running_daemon() as daemon, daemon.client() as client:
        tokens = (await client.final({"op": "tokenize", "text": prompt}))["tokens"]
        done = await client.final({"prompt": prompt, "max_tokens": 1, "stream": False})
        assert done["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize(("tokens", "field"), [
    ([2, 262144], "$.tokens[1]"),        # just past the vocabulary
    ([5, 6, 2**31 - 1], "$.tokens[2]"),
    ([-1], "$.tokens[0]"),
    ([1.5], "$.tokens[0]"),
    ("abc", "$.tokens"),
])
async def test_detokenize_rejects_ids_outside_the_vocabulary(tokens: object, field: str) -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        error = await client.final({"id": 9, "op": "detokenize", "tokens": tokens})
        assert error["type"] == "error" and error["code"] == "invalid_request", error
        assert error["id"] == 9
        assert field in error["message"]
        assert (await client.final({"op": "detokenize", "tokens": [2, 9259]}))["type"] == "text"


async def test_info_reports_model_effective_config_and_versions() -> None:
    config = {"model": {"n_ctx": 2048, "n_batch": 256, "n_ubatch": 128},
              "runtime": {"n_threads": 1}}
    async with running_daemon(config) as daemon, daemon.client() as client:
        info = await client.final({"op": "info"})
    assert info["type"] == "info"
    model = info["model"]
    assert model["architecture"] == "gemma3"
    assert model["n_vocab"] == 262144 and model["n_ctx_train"] == 32768
    assert model["n_params"] > 200_000_000 and model["size_bytes"] > 200_000_000
    assert model["has_chat_template"] is False
    assert model["path"].endswith(".gguf")
    effective = info["config"]
    assert (effective["n_ctx"], effective["batch"], effective["ubatch"]) == (2048, 256, 128)
    assert effective["threads"] == 1
    assert effective["threads_batch"] >= 1  # derived: logical CPUs in the pinned set
    assert effective["cpu_affinity"] and effective["mmap"] is False  # read, for huge pages
    assert effective["huge_page_bytes"] >= 0
    assert effective["chat_template"] == "gemma"
    assert "CPU" in info["system_info"]
    versions = info["versions"]
    assert versions["sfcore"] == __version__
    assert versions["llama_cpp_python"] == "0.3.36"
    assert "ggml" in versions["llama_cpp"]


async def test_stats_count_requests_outcomes_tokens_errors_and_connections() -> None:
    async with running_daemon() as daemon:
        async with daemon.client() as client:
            await client.request({"prompt": "One two three", "max_tokens": 5, "temperature": 0})
            await client.final({"prompt": "One two three", "max_tokens": 3, "stream": False,
                                "temperature": 0})
            await client.final({"op": "tokenize", "text": "x"})
            await client.final(b"{not json}\n")
            await client.final({"op": "generate", "prompt": ""})  # invalid_request
            await client.send(b"\n   \n")  # blank lines are no requests
            await client.final({"op": "health"})
            async with daemon.client() as other:
                stats = await other.final({"op": "stats"})
    requests = stats["requests"]
    assert requests["total"] == 7  # 6 lines on the first connection, the stats itself
    assert requests["by_op"]["generate"] == 2
    assert requests["by_op"]["tokenize"] == requests["by_op"]["health"] == 1
    assert requests["by_op"]["stats"] == 1 and requests["by_op"]["chat"] == 0
    assert requests["by_outcome"]["length"] == 2
    assert sum(requests["by_outcome"].values()) == 2
    assert stats["errors"]["bad_json"] == 1 and stats["errors"]["invalid_request"] == 1
    assert sum(stats["errors"].values()) == 2
    assert stats["tokens"]["generated"] == 8
    assert stats["tokens"]["prompt"] > stats["tokens"]["cached"] > 0  # the second reused the first
    assert stats["connections"] == {"current": 2, "total": 2, "rejected": 0}
    assert stats["decode_tok_s"] > 0 and stats["uptime_s"] > 0


async def test_cancel_a_queued_request_answers_it_at_once_and_leaves_the_running_one() -> None:
    async with running_daemon({"server": {"slots": 1}}) as daemon, daemon.client() as client:
        await client.start_streaming({"id": "running", **LONG},
                                     {"id": "queued", "prompt": "Hi", "max_tokens": 4},
                                     {"id": "c1", "op": "cancel", "target": "queued"})
        async with daemon.client() as monitor:
            health = await monitor.final({"op": "health"})
            assert health["busy"] and health["queue_depth"] == 0  # gone from the queue
        await client.send({"id": "c2", "op": "cancel", "target": "running"})
        replies = [line for line in await client.reply() if line["type"] != "token"]
        assert done_of(replies)["id"] == "running"
        assert done_of(replies)["finish_reason"] == "cancelled"
        queued = await client.reply()
        # Streamed: where it waited, then its done (held behind the running reply).
        assert [line["type"] for line in queued] == ["queued", "done"], queued
        assert queued[0]["position"] == 1 and queued[0]["queue_depth"] == 1, queued
        assert queued[-1]["finish_reason"] == "cancelled"
        assert queued[-1]["usage"]["completion_tokens"] == 0
        assert await client.reply() == [{"type": "cancelled", "id": "c1", "target": "queued",
                                         "found": True}]
        assert await client.reply() == [{"type": "cancelled", "id": "c2", "target": "running",
                                         "found": True}]
        again = await client.final({"op": "cancel", "target": "running"})
        assert again["found"] is False  # already finished


async def test_cancel_stops_a_running_generation_within_a_token() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        await client.start_streaming({"id": 1, **LONG})
        await client.send({"id": 2, "op": "cancel", "target": 1})
        lines = await client.reply()
        done = done_of(lines)
        assert done["finish_reason"] == "cancelled"
        streamed = 1 + len([line for line in lines if line["type"] == "token"])
        # The slot stops within one token of reading the cancel; the tokens already
        # written when it arrived are bounded by the socket, not by max_tokens.
        assert done["usage"]["completion_tokens"] < 2000
        assert done["usage"]["completion_tokens"] >= streamed - 1
        assert (await client.reply())[-1]["found"] is True
        assert (await client.final({"op": "stats"}))["requests"]["by_outcome"]["cancelled"] == 1


async def test_cancel_during_prefill_stops_inside_the_prompt_batch() -> None:
    config = {"model": {"n_ctx": 8192, "n_batch": 4096, "n_ubatch": 512}}
    prompt = "The quick brown fox jumps over the lazy dog. " * 400  # ~4000 tokens, one batch
    async with running_daemon(config) as daemon, daemon.client() as client:
        await client.send({"id": "big", "prompt": prompt, "max_tokens": 4},
                          {"id": "stop", "op": "cancel", "target": "big"})
        done = done_of(await client.reply())
        assert done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] == 0
        assert (await client.reply())[-1]["found"] is True
        after = done_of(await client.request({"prompt": "Hi", "max_tokens": 2}))
        assert after["finish_reason"] in {"length", "stop"}


async def test_cancel_cannot_reach_another_connections_request() -> None:
    async with running_daemon() as daemon, daemon.client() as owner:
        await owner.start_streaming({"id": "mine", **LONG, "max_tokens": 40})
        async with daemon.client() as stranger:
            reply = await stranger.final({"op": "cancel", "target": "mine"})
            assert reply == {"type": "cancelled", "id": reply["id"], "target": "mine",
                             "found": False}
        done = done_of(await owner.reply())
        assert done["finish_reason"] == "length"


async def test_cancel_and_health_are_answered_while_draining() -> None:
    async with running_daemon({"server": {"drain_timeout_s": 60}},
                               expect_clean_exit=False) as daemon:
        async with daemon.client() as client:
            await client.start_streaming({"id": "run", **LONG})
            daemon.signal(signal.SIGTERM)
            await daemon.notification("STOPPING=1", timeout=30)
            await client.send({"op": "health"}, {"op": "cancel", "target": "run"})
            lines = await client.reply()
            assert done_of(lines)["finish_reason"] == "cancelled"
            assert (await client.reply())[-1]["status"] == "draining"
            cancelled = (await client.reply())[-1]
            assert (cancelled["type"], cancelled["target"], cancelled["found"]) == (
                "cancelled", "run", True)
        assert await daemon.wait_exit() == 0


async def test_a_generation_cut_inside_a_character_never_ends_with_a_replacement_char() -> None:
    # U+13000 is four byte tokens in this vocabulary; greedy continues the pattern.
    prompt = "\U00013000" * 8
    async with running_daemon() as daemon, daemon.client() as client:
        for max_tokens in range(1, 9):
            request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "cache_prompt": False}
            whole = done_of(await client.request({**request, "stream": False}))
            streamed = await client.request({**request, "stream": True})
            assert "\ufffd" not in whole["text"]
            assert tokens_text(streamed) == whole["text"]
            assert whole["text"] == "\U00013000" * (max_tokens // 4)
