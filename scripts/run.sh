#!/usr/bin/env bash
# Install what the daemon needs (first run only) and start it on the default model.
# Extra arguments go to sfcore-daemon, e.g. scripts/run.sh --socket /tmp/my.sock
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/sfcore-daemon "$@"
