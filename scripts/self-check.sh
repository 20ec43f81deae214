#!/usr/bin/env bash
# Load the model and decode one multi-token batch in a child process, as the daemon does
# before `ready`; say in one line what failed and what to do. Called by bootstrap.sh after
# an install; extra arguments go to `sfcore-daemon --self-check` (e.g. --model PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
output="$(.venv/bin/sfcore-daemon --self-check "$@" 2>&1)"
status=$?
if [ "$status" -eq 0 ]; then
    printf '%s\n' "$output" | tail -n 1 >&2
    exit 0
fi
printf '%s\n' "$output" | tail -n 40 >&2
if [ "$status" -gt 128 ]; then
    signal="$(kill -l $((status - 128)) 2>/dev/null || echo "signal $((status - 128))")"
    echo "self-check: FAILED: llama.cpp died of SIG$signal in a batched decode: this build of" \
         "llama-cpp-python does not run on this CPU. Rebuild without -march=native:" \
         "rm .venv/.sfcore-installed && SFCORE_PORTABLE=1 scripts/bootstrap.sh" \
         "(docs/operations.md, \"The build and the self-check\")" >&2
else
    echo "self-check: FAILED (exit $status, see above)" >&2
fi
exit 1
