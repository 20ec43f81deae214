"""Huge pages under the weights and the context's buffers (system/hugepages.py): the
maps parser, and a real daemon whose report is the kernel's.

This file holds the tests against the real daemon; those that need no daemon and no
model in tests/unit/system/test_hugepages.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sfcore_daemon.system import hugepages
from tests.kit import running_daemon

THP = hugepages.thp_mode() if sys.platform == "linux" else None


def _anon_huge_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(THP in (None, "never"), reason="no transparent huge pages here")
@pytest.mark.asyncio
async def test_the_weights_lie_in_huge_pages_and_decode_the_same_bytes_as_mapped() -> None:
    request = {"prompt": "The three laws of motion are", "max_tokens": 24,
               "temperature": 0.0, "stream": False, "cache_prompt": False}
    texts, reports = [], []
    for model in ({}, {"use_mmap": True, "huge_pages": False}):
        config = {"model": {"n_ctx": 1024, **model}, "speculative": {"mode": "off"}}
        async with running_daemon(config) as daemon, daemon.client() as client:
            info = await client.final({"op": "info"})
            reports.append((info["config"], info["model"]["size_bytes"],
                            _anon_huge_bytes(daemon.process.pid)))
            texts.append((await client.final(request))["text"])
    (read, size, kernel_says), (mapped, _, _) = reports
    assert read["mmap"] is False and mapped["mmap"] is True
    # What the daemon reports is what the kernel shows of it, and covers the weights
    # (written after the mark, they fault in as huge pages).
    assert size * 0.5 <= read["huge_page_bytes"] <= kernel_says, reports
    assert mapped["huge_page_bytes"] == 0
    assert texts[0] == texts[1] and texts[0]
