"""`[model] n_gpu_layers`: "auto" by default, resolved against the build; the start-up
log says where the layers went (unit tests of the pure parts, and the real daemon on
this machine's build, which in CI has no GPU backend).

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/llama/test_gpu.py.
"""

from __future__ import annotations

import pytest

from sfcore_daemon.llama.gpu import gpu_offload_supported
from tests.kit import running_daemon


def _placement_lines(log: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in log.splitlines()
            if " INFO sfcore_daemon" in line and ": model: " in line]


@pytest.mark.asyncio
@pytest.mark.parametrize("setting", ["auto", -1])
async def test_the_daemon_logs_where_the_layers_went_and_serves(setting: str | int) -> None:
    # On a CPU build (CI's) "auto" is 0 and an explicit -1 stays -1; both load on the CPU.
    gpu = gpu_offload_supported()
    async with running_daemon({"model": {"n_gpu_layers": setting}}) as daemon:
        async with daemon.client() as client:
            health = await client.final({"op": "health"})
            assert health["status"] == "ok"
            info = await client.final({"op": "info"})
            done = await client.final({"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        lines = _placement_lines(daemon.log)
    expected = (-1 if gpu else 0) if setting == "auto" else setting
    assert info["config"]["gpu_layers"] == expected
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 2
    assert len(lines) == 1, daemon.log
    if gpu:
        assert lines[0].startswith("model: 19/19 layers on "), lines
        assert "CPU" not in lines[0]
    else:
        assert lines[0] == "model: 19/19 layers on the CPU " \
                           "(this llama.cpp build has no GPU backend)"
