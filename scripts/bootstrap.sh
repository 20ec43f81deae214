#!/usr/bin/env bash
# Create ./.venv and install sfcore-ai and its Python client (clients/python) into
# it, with the given extras, once per change of either pyproject.toml. llama-cpp-python compiles from source (~6 min on 2 cores);
# pip keeps the built wheel in its cache (~/.cache/pip/wheels), so a later install,
# even into a fresh clone or a new venv, reuses it in seconds.
# Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp=".venv/.sfcore-installed"
want="$(sha256sum pyproject.toml clients/python/pyproject.toml 2>/dev/null | sha256sum | cut -d' ' -f1) $extras" || true
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # Never disable pip's cache here: it is what makes the second install quick.
    unset PIP_NO_CACHE_DIR
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e "$spec"
    # The client distribution needs only the standard library; editable, so the
    # `sfcore` command in .venv/bin always runs the checkout's client.
    if [ -f clients/python/pyproject.toml ]; then
        .venv/bin/python -m pip install --quiet -e ./clients/python
    fi
    echo "$want" > "$stamp"
fi
