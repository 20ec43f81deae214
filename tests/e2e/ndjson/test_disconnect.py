"""Clients that leave or stop reading never hold the slot (real daemon, real socket)."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from tests.kit import Daemon, done_of, running_daemon, tokens_text

pytestmark = pytest.mark.asyncio

LONG = {"prompt": "Write a very long story about a lighthouse keeper.", "max_tokens": 2000,
        "temperature": 0.8, "seed": 1}
QUICK = {"id": "next", "prompt": "Hello", "max_tokens": 4}
# A grammar that never completes: the request ends only by max_tokens or by being cut off.
ENDLESS = {"grammar": "root ::= [a-z ] root"}


async def outcomes(daemon: Daemon) -> dict[str, Any]:
    async with daemon.client() as client:
        stats = await client.final({"op": "stats"})
    return {**stats["requests"]["by_outcome"], "generated": stats["tokens"]["generated"]}


async def test_killing_a_client_mid_stream_ends_its_requests_and_frees_the_slot() -> None:
    # One slot: the next request can run only once the leaver's is stopped.
    async with running_daemon({"server": {"slots": 1}}) as daemon:
        leaver = await daemon.connect()
        # Its queued requests are dropped too.
        await leaver.start_streaming(LONG, LONG, LONG)
        await leaver.close()
        async with daemon.client() as client:
            done = done_of(await client.request(QUICK, timeout=60))
            assert done["usage"]["completion_tokens"] == 4
            health = await client.final({"op": "health"})
            assert health["queue_depth"] == 0
        ended = await outcomes(daemon)
        # The running one was stopped, not run to its 2000 tokens; the queued two never ran.
        assert ended["cancelled"] == 3, ended
        assert ended["generated"] < 1000, ended


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
            # What one 512-token ubatch costs on this machine now (cold, so evaluated).
            ubatch = done_of(await client.request(
                {"prompt": "The quick brown fox jumps over the lazy dog. " * 50,
                 "max_tokens": 1, "cache_prompt": False}))["timings"]["prompt_ms"]
        leaver = await daemon.connect()
        await leaver.send(long_prompt)
        # Connected after the long request was sent, so it is read first; health
        # answers once that prompt is tokenized and in the slot.
        async with daemon.client() as client:
            assert (await client.final({"op": "health"}))["busy"] is True
            await leaver.close()
            done = done_of(after := await client.request(greedy, timeout=60))
            # Stopped inside the batch: about one ubatch of wait, where stopping only
            # between batches would wait for the rest of its ~8.
            assert done["timings"]["queued_ms"] < 4 * ubatch, (ubatch, done["timings"])
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
    # One slot: the stalled client's request must be cut off for the next one to run,
    # and it can end no other way before its ~4000 tokens: its grammar never completes.
    config = {"server": {"max_output_buffer_bytes": 1024, "slots": 1}}
    endless = {"id": "stalled", "stream": True, **LONG, **ENDLESS, "max_tokens": 4000}
    async with running_daemon(config) as daemon:
        # A plain socket that never calls recv (an asyncio reader would keep draining).
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            stalled.settimeout(30)
            stalled.connect(daemon.socket_path)
            stalled.sendall(json.dumps(endless).encode() + b"\n")
            async with daemon.client() as client:
                # The event loop keeps answering while the stalled client's buffers fill.
                assert (await client.final({"op": "health"}))["status"] == "ok"
                done = done_of(await client.request(QUICK, timeout=120))
                assert done["usage"]["completion_tokens"] == 4
            ended = await outcomes(daemon)
            assert ended["cancelled"] == 1 and ended["generated"] < 4000, ended
            # The stalled client finds some tokens, then the end of the connection: no done.
            data = b""
            while chunk := stalled.recv(1 << 16):
                data += chunk
        finally:
            stalled.close()
        lines = [json.loads(line) for line in data.splitlines()]
        assert lines and all(line["type"] == "token" for line in lines)
        assert tokens_text(lines)
