"""The code base stays clean under its own ruff and mypy configuration (pyproject.toml)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.kit import REPO


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_ruff() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


PYTHON_CLIENT = "clients/python"


def test_ruff_covers_the_python_client() -> None:
    """`ruff check .` above lints clients/python with the repository's rules (the client's
    own pyproject.toml has no [tool.ruff] to take over); so are its tests."""
    listed = run("ruff", "check", "--show-files", ".")
    files = {line.strip().removeprefix(str(REPO) + "/") for line in listed.stdout.splitlines()}
    for name in ("__init__.py", "_common.py", "client.py", "aio.py", "cli.py", "__main__.py"):
        assert f"{PYTHON_CLIENT}/sfcore_client/{name}" in files, listed.stdout
    mine = run("ruff", "check", PYTHON_CLIENT, "tests/clients/test_client_python.py",
               "tests/clients/test_sfcore_cli.py")
    assert mine.returncode == 0, mine.stdout + mine.stderr


def test_mypy_strict_on_the_python_client() -> None:
    """mypy --strict with the client's own config (clients/python/pyproject.toml), not the
    daemon's: the package and its benchmark."""
    result = run("mypy", "--config-file", f"{PYTHON_CLIENT}/pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    checked = re.search(r"no issues found in (\d+) source files", result.stdout)
    assert checked and int(checked[1]) >= 7, result.stdout  # the config's files were found
