"""The default model's assembly into the cache (pure file handling, no model load)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_an_interrupted_assembly_leaves_no_partial_file(tmp_path: Path) -> None:
    """Ctrl-C (or SIGTERM, raised during start-up) in the middle of the first assembly
    removes the half-written file; the package is a stand-in that stops half way."""
    from sfcore_daemon.llama import modelfile

    class Interrupted:
        def assemble(self, path: Path, overwrite: bool) -> None:
            Path(path).write_bytes(b"\0" * 4096)
            raise KeyboardInterrupt

    target = tmp_path / "models" / "model.gguf"
    with pytest.raises(KeyboardInterrupt):
        modelfile._assemble(Interrupted(), target)
    assert list(target.parent.iterdir()) == []
