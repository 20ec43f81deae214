"""The daemon says `ready` in its log once it serves: the line people and scripts wait for."""

from __future__ import annotations

import re

import pytest

from tests.kit import running_daemon
from tests.kit.faults import poll_until

pytestmark = pytest.mark.asyncio


async def test_the_log_says_ready_with_the_model_socket_and_slots() -> None:
    async with running_daemon({"server": {"slots": 3}}) as daemon:
        # Logged before READY=1 is sent, but written by the log thread: wait for it.
        async def ready_lines() -> list[str]:
            return [line for line in daemon.log.splitlines() if "ready:" in line]

        lines = await poll_until(ready_lines, bool, timeout=30, what="the ready line")
        assert len(lines) == 1, daemon.log
        assert re.search(r" INFO sfcore_daemon\.core\.server: ready: serving \S.* on "
                         + re.escape(daemon.socket_path) + r" with 3 slots$", lines[0]), lines
        async with daemon.client() as client:
            info = await client.final({"op": "info"})
        assert info["model"]["name"] in lines[0]
