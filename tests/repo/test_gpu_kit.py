"""The GPU check's CPU-side parts (scripts/gpu/, scripts/gpu_check.sh): CI has no GPU, so
what can rot without one is checked here: the shell scripts parse, the stress client
passes against the real daemon (speculation on, as the GPU run uses it) and fails when
the daemon dies, the model metadata extractor reads the default model, and the config
merge takes DAEMON_TOML's dotted keys."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.kit import REPO, running_daemon

GPU = REPO / "scripts" / "gpu"
SHELL_SCRIPTS = [*sorted(GPU.glob("*.sh")), REPO / "scripts" / "gpu_check.sh",
                 REPO / "scripts" / "bootstrap.sh", REPO / "scripts" / "self-check.sh"]


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_the_shell_scripts_parse(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", sorted(GPU.glob("*.py")), ids=lambda p: p.name)
def test_the_python_helpers_compile(script: Path) -> None:
    compile(script.read_text(), str(script), "exec")


def test_the_daemon_config_takes_dotted_overrides(tmp_path: Path) -> None:
    out = tmp_path / "d.toml"
    base = '[server]\nsocket_path = "/tmp/x.sock"\n[model]\npath = "m.gguf"\n'
    extra = "speculative.draft_max = 16\nmodel.n_gpu_layers = 0\nserver.slots = 4\n"
    subprocess.run([sys.executable, str(GPU / "daemon_toml.py"), str(out), base, extra],
                   check=True, timeout=30)
    config = tomllib.loads(out.read_text())
    assert config == {"server": {"socket_path": "/tmp/x.sock", "slots": 4},
                      "model": {"path": "m.gguf", "n_gpu_layers": 0},
                      "speculative": {"draft_max": 16}}
    bad = subprocess.run([sys.executable, str(GPU / "daemon_toml.py"), str(out), base, "x ="],
                         capture_output=True, text=True, timeout=30, check=False)
    assert bad.returncode != 0 and "DAEMON_TOML is not valid TOML" in bad.stderr


def test_the_metadata_extractor_reads_the_default_model(tmp_path: Path) -> None:
    from sfcore_daemon.llama.modelfile import default_model_path

    meta = tmp_path / "meta.json.gz"
    model = str(default_model_path())
    tool = [sys.executable, str(GPU / "make_model.py")]
    subprocess.run([*tool, "extract", model, str(meta)], check=True, timeout=120,
                   capture_output=True)
    # The real file against its own metadata: every KV pair, tensor, shape and type agrees.
    check = subprocess.run([*tool, "check", str(meta), model], capture_output=True, text=True,
                           timeout=120, check=False)
    assert check.returncode == 0, check.stdout
    assert "236 tensors" in check.stdout and "0 mismatches" in check.stdout


async def _stress(socket_path: str, pid: int, out: Path, seconds: float,
                  ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, str(GPU / "spec_stress.py"), "--socket", socket_path,
        "--seconds", str(seconds), "--clients", "8", "--max-tokens", "8",
        "--lengths", "short,64", "--request-timeout", "60", "--pid", str(pid),
        "--json", str(out), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


def _result(out: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.asyncio
async def test_the_stress_client_passes_against_the_real_daemon(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    # The daemon's defaults, speculation on: what the GPU run stresses.
    async with running_daemon() as daemon:
        stress = await _stress(daemon.socket_path, daemon.process.pid, out, 2)
        output, _ = await asyncio.wait_for(stress.communicate(), 150)
    assert stress.returncode == 0, output.decode()
    result = _result(out)
    assert result["ok"] is True and result["daemon_alive"] is True
    assert result["health_after"] == "ok"
    assert result["requests"] >= 8 and result["done"] == result["requests"]
    assert set(result["by_length"]) == {"short", "64"}
    assert result["by_length"]["64"]["prompt_tokens_median"] >= 48


@pytest.mark.asyncio
async def test_the_stress_client_fails_when_the_daemon_dies(tmp_path: Path) -> None:
    out = tmp_path / "stress.json"
    async with running_daemon(expect_clean_exit=False) as daemon:
        stress = await _stress(daemon.socket_path, daemon.process.pid, out, 60)
        assert stress.stdout is not None
        # The clients are under way once it says so (after measuring the prompts).
        first = await asyncio.wait_for(stress.stdout.readline(), 60)
        assert b"8 clients" in first, first
        daemon.signal(signal.SIGKILL)
        await daemon.wait_exit()
        rest, _ = await asyncio.wait_for(stress.communicate(), 90)
    assert stress.returncode == 1, rest.decode()
    result = _result(out)
    assert result["ok"] is False and result["daemon_alive"] is False
    assert result["health_after"] != "ok"
    assert result["errors"] >= 1, result
    assert result["outcomes"].get("lost", 0) >= 1, result
    assert result["wall_s"] < 60  # the clients stop at the first lost connection
