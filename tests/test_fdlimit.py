"""The file-descriptor budget (system/fdlimit.py): RLIMIT_NOFILE against what both
listeners' max_connections may hold, checked once at start-up."""

from __future__ import annotations

import asyncio
import resource
import sys
from pathlib import Path

import pytest

from sfcore_daemon.system import fdlimit
from sfcore_daemon.system.socketfile import StartupError
from tests.harness import REPO

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


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    limits = {"now": (100, 4096)}
    monkeypatch.setattr(fdlimit.resource, "getrlimit", lambda _which: limits["now"])
    monkeypatch.setattr(fdlimit.resource, "setrlimit",
                        lambda _which, value: limits.update(now=value))
    caplog.set_level("INFO", logger=fdlimit.__name__)
    fdlimit.ensure_descriptors(130, "two listeners")
    assert limits["now"] == (4096, 4096)
    assert "soft limit raised from 100 to 4096" in caplog.text
    fdlimit.ensure_descriptors(130, "two listeners")  # enough now: left as it is
    assert limits["now"] == (4096, 4096)
    limits["now"] = (100, 150)
    with pytest.raises(StartupError, match="hard 150"):
        fdlimit.ensure_descriptors(130, "two listeners")


def test_the_service_sets_a_descriptor_limit() -> None:
    unit = (REPO / "systemd" / "sfcore-ai.service").read_text().splitlines()
    assert any(line.startswith("LimitNOFILE=") for line in unit)
