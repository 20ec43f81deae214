"""`sfcore-daemon tune --write`: the recommendation into the config file, atomically."""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from sfcore_daemon.config import CONFIG_FILE_NAME, Config, ConfigError, load_config

EXIT_RUNTIME = 1
EXIT_USAGE = 2


class TuneError(Exception):
    """A problem worded for the user; ends the command with `exit_code`."""

    def __init__(self, message: str, exit_code: int = EXIT_RUNTIME) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class Recommendation:
    n_threads: int
    n_threads_batch: int
    n_ubatch: int
    row_multiple: int  # [speculative]


def config_file(args: argparse.Namespace) -> Path:
    """The file --write changes: the given --config, else ./server_config.toml.

    Symlinks are followed, so the file they point at is replaced, not the link.
    """
    return Path(os.path.realpath(args.config or CONFIG_FILE_NAME))


def check_writable(path: Path) -> None:
    """Fail before a long sweep rather than after it."""
    if not path.parent.is_dir():
        raise TuneError(f"cannot write {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise TuneError(f"cannot write {path}: directory {path.parent} is not writable")


def write_config(path: Path, recommended: Recommendation) -> None:
    """Set the tuned keys in `path`, keeping every other key and value.

    The new text is validated with load_config before it atomically replaces the
    old file, so a reader never sees a half-written or invalid config.
    """
    data = _read_toml(path)
    runtime, model = _table(data, "runtime", path), _table(data, "model", path)
    runtime["n_threads"] = recommended.n_threads
    runtime["n_threads_batch"] = recommended.n_threads_batch
    model["n_ubatch"] = recommended.n_ubatch
    _table(data, "speculative", path)["row_multiple"] = recommended.row_multiple
    n_batch = model.get("n_batch", Config().model.n_batch)
    if isinstance(n_batch, int) and n_batch < recommended.n_ubatch:
        model["n_batch"] = recommended.n_ubatch
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_new_file(temp, tomli_w.dumps(data).encode(), like=path)
        load_config(temp)
        os.replace(temp, path)
    except OSError as exc:
        raise TuneError(f"cannot write {path}: {exc.strerror}") from None
    except ConfigError as exc:
        raise TuneError(f"not writing {path}: the result would be invalid ({exc})") from None
    finally:
        temp.unlink(missing_ok=True)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise TuneError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TuneError(f"invalid config {path}: not valid TOML ({exc})", EXIT_USAGE) from None


def _table(data: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    table = data.setdefault(name, {})
    if not isinstance(table, dict):
        raise TuneError(f"invalid config {path}: `{name}` is not a table", EXIT_USAGE)
    return table


def _write_new_file(temp: Path, content: bytes, like: Path) -> None:
    # 0o666 less the umask for a new config, as any editor would create it.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with os.fdopen(fd, "wb") as file:
        file.write(content)
        file.flush()
        os.fsync(file.fileno())
    if like.exists():
        os.chmod(temp, like.stat().st_mode & 0o7777)
