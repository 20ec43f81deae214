"""The file-descriptor budget (system/fdlimit.py): RLIMIT_NOFILE against what both
listeners' max_connections may hold, checked once at start-up.

This file holds the tests of the daemon's process (start-up, exit); those that need no
daemon and no model in tests/unit/system/test_fdlimit.py.
"""

from __future__ import annotations

import asyncio
import resource
import sys
from pathlib import Path

import pytest

from tests.kit import REPO

WAIT_S = 60.0


@pytest.mark.asyncio
async def test_a_descriptor_limit_too_low_for_max_connections_stops_startup(
        tmp_path: Path) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))

    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfcore_daemon", "--socket", str(tmp_path / "s"),
        "--openai", "127.0.0.1:0", stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=str(REPO), preexec_fn=low_limit)
    try:
        output, _ = await asyncio.wait_for(process.communicate(), WAIT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = output.decode()
    assert process.returncode == 1, text
    assert text.count("\n") == 1 and "Traceback" not in text, text
    assert "RLIMIT_NOFILE" in text and "max_connections" in text, text
