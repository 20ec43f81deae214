"""The measured step costs (llama/stepcost.py) on disk, one small JSON file per model,
build, CPU and context settings (the name is their hash), so that only a daemon's
first start on a machine measures them. A file that does not read as costs is
measured again and replaced: it is a cache, never an error."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec

log = logging.getLogger(__name__)

# rows -> ns; at most a few dozen sizes, each a time under ten seconds. Rows 0 to -4: what
# rows cost by the context they attend to, and a prompt row (llama/stepcost.py's keys).
_Rows = Annotated[int, msgspec.Meta(ge=-4, le=4096)]
_Nanoseconds = Annotated[float, msgspec.Meta(ge=0, lt=1e10)]
_MAX_BYTES = 64 << 10


class CostsFile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    version: int
    ns: dict[_Rows, _Nanoseconds]


_VERSION = 3
_decoder = msgspec.json.Decoder(CostsFile)


def parse(data: bytes) -> dict[int, float] | None:
    """The costs in `data`; None unless it is a whole, current costs file with a
    one-row step and at least one more size."""
    if len(data) > _MAX_BYTES:
        return None
    try:
        costs = _decoder.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    ns = costs.ns
    if (costs.version != _VERSION or 1 not in ns or sum(rows > 0 for rows in ns) < 2
            or any(rows > 0 and value <= 0 for rows, value in ns.items())):
        return None
    return dict(costs.ns)


def load(path: Path) -> dict[int, float] | None:
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_BYTES + 1)
    except OSError:
        return None
    return parse(data)


def save(path: Path, ns: dict[int, float]) -> None:
    """Write atomically (a temp file renamed over it); a failure is logged, not raised:
    the next start measures again."""
    data = msgspec.json.encode(CostsFile(version=_VERSION, ns=ns))
    try:
        write_atomically(path, data)
    except OSError as exc:
        log.warning("could not keep the measured step costs in %s: %s", path, exc)


def write_atomically(path: Path, data: bytes) -> None:
    """`data` in a temp file beside `path`, renamed over it; OSError if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as temp:
        temp.write(data)
    os.replace(temp.name, path)


def discard(path: Path) -> bool:
    """Remove a kept file whose costs no longer describe the machine, so that the next
    start measures again; False if there was none or it would not go (logged)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not remove the step costs in %s: %s", path, exc)
        return False
    return True
