"""The bench scripts' package (scripts/benchkit) for tests of its pure parts."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from tests.kit.daemon import REPO


def benchkit_module(name: str) -> Any:
    """A module of scripts/benchkit, loaded the way scripts/bench.py loads it."""
    sys.path[:0] = [str(REPO / "scripts"), str(REPO)]
    try:
        return importlib.import_module(name)
    finally:
        del sys.path[:2]
