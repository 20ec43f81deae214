"""Config decoding and CLI overrides (unit), and config errors at startup (real CLI).

This file holds the tests of the daemon's process (start-up, exit); those that need no
daemon and no model in tests/unit/config/test_config.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kit import run_cli


@pytest.mark.asyncio
async def test_bad_config_stops_startup_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nmax_queue = -1\nbogus = 1\n")
    code, output = await run_cli("--config", str(path))
    assert code == 2
    assert output.count("\n") == 1, output
    assert "Traceback" not in output
    assert str(path) in output


@pytest.mark.asyncio
async def test_missing_config_file_is_one_line(tmp_path: Path) -> None:
    code, output = await run_cli("--config", str(tmp_path / "absent.toml"))
    assert code == 2
    assert "cannot read config" in output and "Traceback" not in output
