"""Clients that leave or stop reading never hold the slot (real daemon, real socket)."""

from __future__ import annotations

import json
import socket

import pytest

from tests.harness import done_of, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

LONG = {"prompt": "Write a very long story about a lighthouse keeper.", "max_tokens": 2000,
        "temperature": 0.8, "seed": 1}
QUICK = {"id": "next", "prompt": "Hello", "max_tokens": 4}


async def test_killing_a_client_mid_stream_frees_the_slot_within_a_second() -> None:
    async with running_daemon() as daemon:
        leaver = await daemon.connect()
        # Its queued requests are dropped too.
        await leaver.start_streaming(LONG, LONG, LONG)
        await leaver.close()
        async with daemon.client() as client:
            done = done_of(await client.request(QUICK, timeout=30))
            # The 2000-token request would have held the slot for ~35 s.
            assert done["timings"]["queued_ms"] < 1000, done["timings"]
            health = await client.final({"op": "health"})
            assert health["queue_depth"] == 0


async def test_client_gone_during_prefill_stops_inside_a_prompt_batch() -> None:
    # ~4000 prompt tokens in one 4096-token batch: about ten seconds of llama_decode,
    # which only llama.cpp's abort callback can interrupt.
    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 400,
                   "max_tokens": 50}
    greedy = {"id": "next", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    config = {"model": {"n_ctx": 8192, "n_batch": 4096, "n_ubatch": 512}}
    async with running_daemon(config) as daemon:
        async with daemon.client() as client:
            before = tokens_text(await client.request(greedy))
        leaver = await daemon.connect()
        await leaver.send(long_prompt)
        # Connected after the long request was sent, so it is read first; health
        # answers once that prompt is tokenized and in the slot.
        async with daemon.client() as client:
            assert (await client.final({"op": "health"}))["busy"] is True
            await leaver.close()
            done = done_of(after := await client.request(greedy, timeout=60))
            # Between batches only, this would wait for the whole ~10 s batch.
            assert done["timings"]["queued_ms"] < 2000, done["timings"]
            # The rows evaluated before the abort are gone from the cache.
            assert tokens_text(after) == before


async def test_half_closed_client_still_gets_every_reply() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        await client.send({"id": 1, "prompt": "Hi", "max_tokens": 6},
                          {"id": 2, "op": "health"})
        sock = client.writer.get_extra_info("socket")
        sock.shutdown(socket.SHUT_WR)  # what `socat` does at the end of its input
        first = await client.reply()
        assert done_of(first)["id"] == 1
        assert done_of(first)["usage"]["completion_tokens"] == 6
        assert (await client.reply())[-1]["type"] == "health"
        await client.expect_eof()  # then the daemon closes


async def test_a_client_that_stops_reading_is_cut_off_and_never_stalls_anyone() -> None:
    # One slot: the stalled client's request must be cut off for the next one to run.
    config = {"server": {"max_output_buffer_bytes": 1024, "slots": 1}}
    async with running_daemon(config) as daemon:
        # A plain socket that never calls recv (an asyncio reader would keep draining).
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            stalled.settimeout(30)
            stalled.connect(daemon.socket_path)
            stalled.sendall(json.dumps({"id": "stalled", "stream": True, **LONG}).encode()
                            + b"\n")
            async with daemon.client() as client:
                # The event loop keeps answering while the stalled client's buffers fill.
                assert (await client.final({"op": "health"}))["status"] == "ok"
                done = done_of(await client.request(QUICK, timeout=60))
                # The slot was freed once ~12 KB (socket buffer) + 1 KB went unread, long
                # before the 2000 tokens (~35 s) would have finished.
                assert done["timings"]["queued_ms"] < 20_000, done["timings"]
            # The stalled client finds some tokens, then the end of the connection: no done.
            data = b""
            while chunk := stalled.recv(1 << 16):
                data += chunk
        finally:
            stalled.close()
        lines = [json.loads(line) for line in data.splitlines()]
        assert lines and all(line["type"] == "token" for line in lines)
        assert tokens_text(lines)
