"""The chat template's sandbox budget (issue 50): a template that loops or grows without
end is stopped within its time or size budget, never a thread spinning forever; real
templates render exactly as in jinja's own sandbox; a configured template past the
budget stops the daemon at start-up with one line.

This file holds the tests of the daemon's process (start-up, exit); those that need no
daemon and no model in tests/unit/core/test_sandbox.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kit import run_cli


@pytest.mark.asyncio
async def test_a_configured_template_past_the_budget_stops_start_up_in_one_line(
        tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[model]\nchat_template = "{% for i in range(100000) %}'
                      '{% for j in range(100000) %}{% endfor %}{% endfor %}"\n')
    code, output = await run_cli("--config", str(config), "--socket", str(tmp_path / "s"))
    assert code == 1, output
    assert "model.chat_template: refused: the chat template went past its budget" in output
    assert "Traceback" not in output
