#!/usr/bin/env bash
# Create ./.venv and install sfcore-ai and its Python client (clients/python) into
# it, with the given extras, once per change of either pyproject.toml. llama-cpp-python compiles from source (~6 min on 2 cores);
# pip keeps the built wheel in its cache (~/.cache/pip/wheels), so a later install,
# even into a fresh clone or a new venv, reuses it in seconds.
# Usage: scripts/bootstrap.sh [extras]   e.g. scripts/bootstrap.sh test
#
# SFCORE_GPU=cuda: llama-cpp-python built with CUDA instead (CMAKE_ARGS="-DGGML_CUDA=on"
# followed by your own CMAKE_ARGS, so a -D of yours wins; CUDAARCHS=90 picks the GPU
# architectures, else llama.cpp builds for the GPU it sees). pip's wheel cache keys a wheel
# built from an sdist by the sdist's link alone, not by CMAKE_ARGS: a CUDA build there would
# be handed to the next CPU install and the reverse. So the CUDA build never touches pip's
# cache: `pip wheel --no-cache-dir` builds it once into a folder of its own,
# ~/.cache/sfcore-ai/wheels/cuda-<hash of the version and build arguments>, and it is
# installed from there (seconds, later). Without SFCORE_GPU (or with SFCORE_GPU=cpu) a
# venv that holds a CUDA build gets the CPU build back from pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
gpu="${SFCORE_GPU:-cpu}"
case "$gpu" in
    cpu | cuda) ;;
    *) echo "bootstrap: SFCORE_GPU must be cuda or cpu, not '$gpu'" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
stamp=".venv/.sfcore-installed"
want="$(sha256sum pyproject.toml clients/python/pyproject.toml 2>/dev/null | sha256sum | cut -d' ' -f1) $extras" || true
# The pinned requirement, e.g. llama-cpp-python==0.3.36 (pyproject.toml is its one source).
llama="$(grep -o 'llama-cpp-python==[^"]*' pyproject.toml || true)"
if [ "$gpu" = cuda ]; then
    [ -n "$llama" ] || { echo "bootstrap: no llama-cpp-python==VERSION pin in pyproject.toml" >&2; exit 1; }
    cuda_cmake_args="-DGGML_CUDA=on${CMAKE_ARGS:+ $CMAKE_ARGS}"
    key="$(printf '%s\n' "$llama" "$cuda_cmake_args" "${CUDAARCHS:-}" | sha256sum | cut -c1-16)"
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/sfcore-ai/wheels/cuda-$key"
    # The CPU stamp stays as it always was; a CUDA install is told apart by its suffix.
    want="$want cuda-$key"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # Never disable pip's cache here: it is what makes the second install quick.
    unset PIP_NO_CACHE_DIR
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    .venv/bin/python -m pip install --quiet --upgrade pip
    if [ "$gpu" = cuda ]; then
        if ! compgen -G "$wheels/llama_cpp_python-*.whl" > /dev/null; then
            echo "bootstrap: building $llama with CMAKE_ARGS=\"$cuda_cmake_args\" into $wheels" \
                 "(several minutes; needs nvcc and cuBLAS)" >&2
            mkdir -p "$wheels"
            partial="$(mktemp -d "$wheels.partial.XXXXXX")"
            CMAKE_ARGS="$cuda_cmake_args" .venv/bin/python -m pip wheel --quiet --no-deps \
                --no-cache-dir --no-binary llama-cpp-python -w "$partial" "$llama" \
                || { rm -rf "$partial"; exit 1; }
            mv "$partial"/llama_cpp_python-*.whl "$wheels/"
            rm -rf "$partial"
        fi
        # Replaces whatever build is installed; its dependencies come with the project below.
        .venv/bin/python -m pip install --quiet --force-reinstall --no-deps \
            "$wheels"/llama_cpp_python-*.whl
    elif compgen -G ".venv/lib/python3*/site-packages/llama_cpp/lib/libggml-cuda*" > /dev/null \
         || grep -qs '/sfcore-ai/wheels/cuda-' \
              .venv/lib/python3*/site-packages/llama_cpp_python-*.dist-info/direct_url.json; then
        # Back from a CUDA build: the same version, so pip would keep it; take pip's CPU build.
        .venv/bin/python -m pip install --quiet --force-reinstall --no-deps "$llama"
    fi
    .venv/bin/python -m pip install --quiet -e "$spec"
    # The client distribution needs only the standard library; editable, so the
    # `sfcore` command in .venv/bin always runs the checkout's client.
    if [ -f clients/python/pyproject.toml ]; then
        .venv/bin/python -m pip install --quiet -e ./clients/python
    fi
    echo "$want" > "$stamp"
fi
