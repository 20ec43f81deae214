"""The code base stays clean under its own ruff and mypy configuration (pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_ruff() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_on_the_python_client() -> None:
    result = run("mypy", "--strict", "clients/python/sfcore_client")
    assert result.returncode == 0, result.stdout + result.stderr
