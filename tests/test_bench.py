"""scripts/bench.py runs end to end (one short run; its figures are not judged here)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.asyncio


async def test_bench_prints_every_figure_and_writes_json() -> None:
    results = Path(tempfile.mkdtemp(prefix="sfbench-")) / "results.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "scripts/bench.py", "--runs", "1", "--tokens", "16", "--no-peer",
        "--json", str(results), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, stderr.decode()[-2000:]
    table = stdout.decode()
    for label in ("decode, greedy", "decode, sampled", "prefill, 512-token prompt",
                  "first token, short cold prompt", "1000-token prefix cached",
                  "process start to ready", "4 concurrent clients", "peak RSS"):
        assert label in table, label
    assert "[run 1/1]" in stderr.decode()  # progress is shown
    data = json.loads(results.read_text())
    assert len(data["samples"]["daemon"]) == len(data["samples"]["ceiling"]) == 1
    daemon = data["samples"]["daemon"][0]
    assert daemon["decode_tokens"] > 1 and daemon["prefix_cached_tokens"] >= 900
    assert {t["target"].split(" ")[0] for t in data["targets"]} >= {
        "decode", "prefill", "sampled", "ready", "peak"}
