#!/usr/bin/env bash
# The GPU check (scripts/gpu/): on an NVIDIA GPU machine with nvcc, CMake and ninja, build
# llama.cpp with CUDA from the pinned llama-cpp-python's source, make a random-weight model
# of the default model's exact shapes and types, and run the daemon's crash stress (8
# concurrent speculative clients; every request must end `done`), llama-bench, and the
# daemon's and llama-server's benches. About 5 minutes on an H200 (the build ~150 s, the
# stress 60 s; docs/gpu.md).
# Results: $OUT/results.md and results.json (OUT defaults to KIT/out).
#
#   scripts/gpu_check.sh              make the kit if it is missing or stale, then run it
#   scripts/gpu_check.sh --prepare    only make the kit (any machine with network; no GPU)
#   scripts/gpu_check.sh --run        only run it (a GPU machine without network that got
#                                     the kit folder, e.g. a device run carrying .gpukit)
#
# KIT (default .gpukit, git-ignored) holds the pruned llama.cpp source, the model's
# metadata, the wheels a bare Python 3.12 lacks and a snapshot of the daemon; the scripts
# and the daemon run from this checkout. Env as for scripts/gpu/run.sh: STEPS, STRESS_S,
# DAEMON_ENV, DAEMON_TOML, WORK, ...
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in
    --prepare) mode=prepare ;;
    --run) mode=run ;;
    "") ;;
    *) echo "usage: scripts/gpu_check.sh [--prepare | --run]" >&2; exit 2 ;;
esac
kit="${KIT:-.gpukit}"
version="$(grep -o 'llama-cpp-python==[^"]*' pyproject.toml | cut -d= -f3)"
fresh() {  # the kit exists and holds the pinned version's source
    local first
    [ -f "$kit/llama-src.tar.gz" ] && [ -f "$kit/model_meta.json.gz" ] || return 1
    first="$(tar -tzf "$kit/llama-src.tar.gz" 2>/dev/null | head -1 || true)"
    [ "${first%%/*}" = "llama_cpp_python-$version" ]
}
if [ $mode = prepare ] || { [ $mode = all ] && ! fresh; }; then
    [ -x .venv/bin/python ] || scripts/bootstrap.sh
    scripts/gpu/prepare.sh "$kit"
fi
if [ $mode = prepare ]; then
    echo "kit ready in $kit; on a GPU machine, from this checkout's root: scripts/gpu_check.sh --run"
    exit 0
fi
fresh || { echo "gpu_check: no kit for llama-cpp-python $version in $kit: scripts/gpu_check.sh --prepare first" >&2; exit 1; }
OUT="${OUT:-$kit/out}" KIT_DATA="$kit" exec bash scripts/gpu/run.sh
