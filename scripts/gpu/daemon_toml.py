#!/usr/bin/env python3
"""Write a daemon config: BASE (TOML text) with EXTRA (TOML text, e.g. DAEMON_TOML's
`speculative.draft_max = 16` lines) merged over it, table by table.

  daemon_toml.py OUT.toml BASE-TOML-TEXT [EXTRA-TOML-TEXT]

Needs tomli-w (the kit carries its wheel); tomllib is in Python 3.11+.
"""

from __future__ import annotations

import sys
import tomllib
from typing import Any

import tomli_w


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def main() -> int:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    config = tomllib.loads(sys.argv[2])
    if len(sys.argv) == 4 and sys.argv[3].strip():
        try:
            config = merge(config, tomllib.loads(sys.argv[3]))
        except tomllib.TOMLDecodeError as exc:
            sys.exit(f"daemon_toml: DAEMON_TOML is not valid TOML: {exc}")
    with open(sys.argv[1], "wb") as fh:
        tomli_w.dump(config, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
