#!/usr/bin/env bash
# Install the test dependencies (first run only) and run the whole test suite
# against the real default model.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
# Go and Debian's Rust crates for the native client tests (installed once, if missing).
scripts/os-deps.sh
exec .venv/bin/python -m pytest "$@"
