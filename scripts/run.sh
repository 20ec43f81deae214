#!/usr/bin/env bash
# Install what the daemon needs (first run only) and start it on the default model.
# Extra arguments go to sfcore-daemon, e.g. scripts/run.sh --socket /tmp/my.sock
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# libgomp's spin window (docs/operations.md, "Sharing the machine"): yours wins, and so
# does the spin of an OMP_WAIT_POLICY you set.
if [ -z "${GOMP_SPINCOUNT+set}" ] && [ -z "${OMP_WAIT_POLICY+set}" ]; then
    export GOMP_SPINCOUNT=30000
fi
exec .venv/bin/sfcore-daemon "$@"
