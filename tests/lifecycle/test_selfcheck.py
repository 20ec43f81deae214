"""The warm-up decode as a check of the llama.cpp build (issue 48): a library that traps
on a batched decode ends start-up with the signal and the stack, never a ready line; the
install script's self-check says in one line what failed and what to do."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.kit import READY_TIMEOUT_S, REPO, run_cli, running_daemon

TRAP = {"SFCORE_FAILPOINT": "warmup_trap"}


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "c.toml"
    config.write_text('[model]\nn_ctx = 1024\n[log]\nlevel = "info"\n')
    return config


@pytest.mark.asyncio
async def test_a_build_that_traps_on_a_batched_decode_dies_at_start_up_with_its_stack(
        tmp_path: Path) -> None:
    code, output = await run_cli("--config", str(_config(tmp_path)),
                                 "--socket", str(tmp_path / "s"),
                                 env=dict(os.environ, **TRAP))
    assert code == -signal.SIGILL, output
    # faulthandler names the signal and the frame that was decoding the batch.
    assert "Fatal Python error: Illegal instruction" in output
    assert "in check_batched_decode" in output and "in warm_up" in output
    assert "ready:" not in output


@pytest.mark.asyncio
async def test_the_daemon_decodes_a_batch_before_it_says_ready() -> None:
    async with running_daemon() as daemon, daemon.client() as client:
        done = await client.final({"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 4
        # The warm-up's cells are gone: the first request found nothing cached.
        assert done["usage"]["cached_tokens"] == 0
        assert "warm-up batch decoded in" in daemon.log


@pytest.mark.asyncio
async def test_self_check_passes_on_the_default_model() -> None:
    code, output = await run_cli("--self-check")
    assert code == 0, output
    assert output.strip().splitlines()[-1].startswith("self-check: ok: ")
    assert "Traceback" not in output


@pytest.mark.asyncio
async def test_self_check_names_a_missing_model_in_one_line(tmp_path: Path) -> None:
    code, output = await run_cli("--self-check", "--model", str(tmp_path / "no.gguf"))
    assert code == 1
    assert "model file not found" in output and "Traceback" not in output


@pytest.mark.asyncio
async def test_the_install_scripts_self_check_says_what_failed_and_what_to_do() -> None:
    script = REPO / "scripts" / "self-check.sh"
    venv_daemon = REPO / ".venv" / "bin" / "sfcore-daemon"
    if not venv_daemon.exists() or Path(sys.prefix) != (REPO / ".venv").resolve():
        pytest.skip("needs the checkout's .venv (scripts/bootstrap.sh)")
    process = await asyncio.create_subprocess_exec(
        "bash", str(script), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, **TRAP))
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), READY_TIMEOUT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 1
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("self-check: FAILED: llama.cpp died of SIGILL in a batched decode")
    assert "SFCORE_PORTABLE=1 scripts/bootstrap.sh" in last
