"""`sfcore-daemon tune` on the real default model, run as a user runs it (real CLI)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import tomli_w

from sfcore_daemon.config import load_config
from sfcore_daemon.tune.rows import ROW_MULTIPLES, SAWTOOTH, leftover_shares, row_sizes
from tests.kit import BASE_CONFIG, merge, run_cli

pytestmark = pytest.mark.asyncio

# Small enough for a few seconds per run; still one real sweep over threads x n_ubatch.
QUICK = ("--runs", "1", "--tokens", "8", "--prompt-tokens", "64", "--ubatch", "64,128")
SWEPT_UBATCH = {64, 128}
# Costs printed to 0.1 ms move a share by at most ~0.02 with the default model's steps.
PRINTED_MARGIN = 0.05
TUNE_TIMEOUT_S = 120.0
RECOMMENDED = re.compile(
    r"^recommended: n_threads = (\d+), n_threads_batch = (\d+), n_ubatch = (\d+), "
    r"row_multiple = (\d+)$", re.M)

# Non-default values the tuner must keep when it rewrites the file.
USER_CONFIG = merge(BASE_CONFIG, {
    "server": {"max_queue": 7},
    "generation": {"temperature": 0.3},
    "model": {"n_ctx": 2048},
    "speculative": {"draft_max": 32},
})


def write_config(tmp_path: Path, config: dict[str, object] | None = None) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(tomli_w.dumps(config or USER_CONFIG))
    return path


def recommended(output: str) -> tuple[int, int, int, int]:
    match = RECOMMENDED.search(output)
    assert match, output
    n_threads, n_threads_batch, n_ubatch, row_multiple = map(int, match.groups())
    return n_threads, n_threads_batch, n_ubatch, row_multiple


def assert_one_error_line(output: str) -> None:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("sfcore-daemon tune: ")]
    assert len(errors) == 1, output


async def test_write_stores_the_sweep_result_and_keeps_other_settings(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    os.chmod(path, 0o640)
    code, output = await run_cli("tune", "--config", str(path), "--write", *QUICK,
                                 timeout=TUNE_TIMEOUT_S)
    assert code == 0, output
    assert "decode:" in output and "prefill:" in output, output
    assert re.search(r"^\[7/7\] prefill threads_batch=\d+ n_ubatch=128: [\d.]+ tok/s$",
                     output, re.M), output
    n_threads, n_threads_batch, n_ubatch, row_multiple = recommended(output)
    assert f"wrote n_threads, n_threads_batch, n_ubatch and row_multiple to {path}" in output
    # Every measured step size has its cost, and the choice is the one the costs give:
    # no larger multiple reaches the threshold, the chosen one does. (The printed costs
    # have one decimal, so the shares recomputed from them get a margin.)
    rows = re.search(r"^  rows ([\d ]+)$", output, re.M)
    times = re.search(r"^  ms   ([\d. ]+)$", output, re.M)
    assert rows and times, output
    costs = {int(size): float(ms)
             for size, ms in zip(rows[1].split(), times[1].split(), strict=True)}
    assert sorted(costs) == list(row_sizes()) and all(ms > 0 for ms in costs.values())
    shares = leftover_shares(costs)
    assert row_multiple in (*ROW_MULTIPLES, 1)
    assert all(shares[m] < SAWTOOTH + PRINTED_MARGIN for m in ROW_MULTIPLES if m > row_multiple)
    assert row_multiple == 1 or shares[row_multiple] >= SAWTOOTH - PRINTED_MARGIN

    config = load_config(path)
    n_cpus = len(os.sched_getaffinity(0))
    assert 1 <= config.runtime.n_threads == n_threads <= n_cpus
    assert 1 <= config.runtime.n_threads_batch == n_threads_batch <= n_cpus
    assert config.model.n_ubatch == n_ubatch
    assert n_ubatch in SWEPT_UBATCH
    assert config.speculative.row_multiple == row_multiple
    assert config.speculative.draft_max == 32
    assert config.server.max_queue == 7
    assert config.generation.temperature == 0.3
    assert config.model.n_ctx == 2048
    assert config.log.level == "info"
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert list(tmp_path.iterdir()) == [path], "temp file left behind"


async def test_without_write_the_file_is_untouched(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    before = path.read_bytes()
    code, output = await run_cli("tune", "--config", str(path), "--threads", "1", *QUICK,
                                 timeout=TUNE_TIMEOUT_S)
    assert code == 0, output
    assert recommended(output)[:2] == (1, 1)
    assert "--write" in output
    assert path.read_bytes() == before


async def test_a_batch_too_small_for_the_row_steps_keeps_the_configured_row_multiple(
        tmp_path: Path) -> None:
    config = merge(USER_CONFIG, {"model": {"n_batch": 16, "n_ubatch": 16},
                                 "speculative": {"row_multiple": 2}})
    path = write_config(tmp_path, config)
    code, output = await run_cli("tune", "--config", str(path), "--threads", "1", "--runs",
                                 "1", "--tokens", "8", "--prompt-tokens", "32", "--ubatch",
                                 "16", "--write", timeout=TUNE_TIMEOUT_S)
    assert code == 0, output
    assert "logit rows a step: not measured (n_batch 16 is below 32)" in output, output
    assert recommended(output)[3] == 2
    assert load_config(path).speculative.row_multiple == 2


@pytest.mark.parametrize("args", [
    ("--model", "/nonexistent.gguf"),
    ("--runs", "0"),
    ("--ubatch", "1024"),
    ("--bogus",),
])
async def test_user_mistakes_are_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    path = write_config(tmp_path)
    before = path.read_bytes()
    code, output = await run_cli("tune", "--config", str(path), "--write", *args,
                                 timeout=TUNE_TIMEOUT_S)
    assert code in {1, 2}, output
    assert_one_error_line(output)
    assert path.read_bytes() == before


async def test_unknown_config_key_is_a_usage_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, merge(USER_CONFIG, {"runtime": {"n_thread": 2}}))
    code, output = await run_cli("tune", "--config", str(path), timeout=TUNE_TIMEOUT_S)
    assert code == 2
    assert_one_error_line(output)
    assert "unknown key `runtime.n_thread`" in output


async def test_a_file_that_is_not_a_model_gives_llama_cpps_reason(tmp_path: Path) -> None:
    path = write_config(tmp_path)
    corrupt = tmp_path / "not-a-model.gguf"
    corrupt.write_bytes(b"hello, not a GGUF file\n")
    code, output = await run_cli("tune", "--config", str(path), "--model", str(corrupt),
                                 timeout=TUNE_TIMEOUT_S)
    assert code == 1
    assert_one_error_line(output)
    assert f"cannot load model {corrupt}: invalid magic characters" in output
