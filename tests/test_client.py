"""The standard-library Python client in clients/python against the real daemon."""

from __future__ import annotations

import asyncio
import sys

import pytest

from tests.harness import REPO, running_daemon

sys.path.insert(0, str(REPO / "clients" / "python"))
import sfcore_client

pytestmark = pytest.mark.asyncio


def exercise(path: str) -> tuple[str, dict[str, object], str, str]:
    with sfcore_client.Client(path, timeout=60) as client:
        streamed = "".join(client.generate("Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                           cache_prompt=False))
        assert client.last_done is not None
        whole = client.generate("Count: 1, 2, 3,", stream=False, max_tokens=8,
                                temperature=0, cache_prompt=False)
        try:
            client.generate("x", stream=False, max_tokens=0)
        except sfcore_client.SfcoreError as error:
            code = error.code
        else:
            code = "no error"
        status = client.health()["status"]
    return streamed, whole, code, str(status)


async def test_python_client_streams_and_raises_structured_errors() -> None:
    async with running_daemon() as daemon:
        streamed, whole, code, status = await asyncio.wait_for(
            asyncio.to_thread(exercise, daemon.socket_path), 120)
    assert streamed == whole["text"] != ""
    assert whole["finish_reason"] == "length"
    assert code == "invalid_request"
    assert status == "ok"
