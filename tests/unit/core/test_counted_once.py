"""A generation's outcome is counted in `stats` exactly once, also when a write drops
the connection just before the `done` line.

The event-loop half of a generation (output.Generation) writing through a real
Connection to a real socket whose peer has shut its reading side: the first write
fails (EPIPE) and leaves the transport closing, and the next one drops the connection,
which abandons the generation, as it does in the daemon. What the decode thread would
hand over is handed over here, piece by piece, so the order is exact.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from sfcore_daemon.config import Config
from sfcore_daemon.core.generation import Generation
from sfcore_daemon.core.scheduler import Scheduler
from sfcore_daemon.core.stats import Stats
from sfcore_daemon.engine.crossing import JobEnd
from sfcore_daemon.llama.sampling import Sampling
from sfcore_daemon.ndjson.connection import Connection, GenerationReply

pytestmark = pytest.mark.asyncio


@dataclass
class _Server:
    config: Config = field(default_factory=Config)
    stats: Stats = field(default_factory=Stats)
    scheduler: Scheduler | None = None

    async def handle(self, *_args: Any) -> bool:
        return True


@dataclass
class _Peer:
    server: _Server
    connection: Connection
    client: socket.socket


@pytest_asyncio.fixture
async def peer() -> AsyncIterator[_Peer]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    server = _Server()
    server.scheduler = Scheduler(engine=None, max_queue=4)  # type: ignore[arg-type]
    # The client will never read again: every write to it fails.
    theirs.shutdown(socket.SHUT_RD)
    try:
        yield _Peer(server, Connection(server, reader, writer), theirs)
    finally:
        writer.close()
        theirs.close()


def _generation(peer: _Peer, stops: tuple[str, ...]) -> Generation:
    slot = peer.connection.open_slot()
    generation = Generation(
        request_id="g", stream=True, stops=stops, prompt=[2, 100, 101], max_tokens=8,
        sampling=Sampling(temperature=0.0, top_k=40, top_p=1.0, min_p=0.0,
                          repeat_penalty=1.0, seed=None),
        cache_prompt=True, sink=GenerationReply(slot, "g"), arrived_ns=0,
        loop=asyncio.get_running_loop(), stats=peer.server.stats)
    slot.attach(generation)
    return generation


def _hand_over(generation: Generation, piece: bytes) -> None:
    generation.channel.pieces.append((piece, 1))


def _counted(stats: Stats) -> tuple[int, int]:
    return sum(stats.by_outcome.values()), stats.generated_tokens


async def test_the_text_up_to_a_stop_sequence_drops_the_connection(peer: _Peer) -> None:
    generation = _generation(peer, ("STOP",))
    _hand_over(generation, b"Hello")
    generation._drain()  # written: EPIPE, the transport is closing
    assert not peer.connection.gone
    _hand_over(generation, b" world STOP")
    generation._drain()  # the text before the stop drops it; then the done line
    assert peer.connection.gone and generation.replied
    assert _counted(peer.server.stats) == (1, 2), peer.server.stats.by_outcome
    assert peer.server.stats.by_outcome["cancelled"] == 1


async def test_the_held_back_tail_drops_the_connection(peer: _Peer) -> None:
    generation = _generation(peer, ("ABC",))
    _hand_over(generation, b"Hello")
    generation._drain()  # written: EPIPE, the transport is closing
    # "AB" may begin the stop sequence: held back until the end, then written.
    _hand_over(generation, b"AB")
    generation._finished(JobEnd("length"))
    assert peer.connection.gone and generation.replied
    assert _counted(peer.server.stats) == (1, 2), peer.server.stats.by_outcome
    assert peer.server.stats.by_outcome["cancelled"] == 1
