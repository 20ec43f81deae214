#!/usr/bin/env bash
# Make a GPU check kit on a CPU machine (no GPU needed), into a folder a GPU machine without
# network can run from:
#   scripts/gpu/prepare.sh KIT-DIR
# KIT-DIR gets: this folder's scripts (run.sh, bench.py, spec_stress.py, make_model.py,
# daemon_toml.py), tests/kit (the NDJSON client bench.py uses), llama-src.tar.gz
# (llama-cpp-python's sdist of the pinned version, pruned to the CPU and CUDA backends, ~7
# MB), model_meta.json.gz (the default model's metadata, tokenizer and tensor list, for a
# random-weight copy of the same shapes), sfcore.tar (a snapshot of this checkout's daemon,
# working tree included; run.sh prefers the checkout it is started in) and whl/ (msgspec,
# tomli-w, typing_extensions for CPython 3.12, which the GPU machine lacks). About 10 MB.
# Then, on the GPU machine: OUT=<dir> bash KIT-DIR/run.sh (see run.sh). Needs ./.venv
# (scripts/bootstrap.sh) and, unless SDIST names the sdist (a .tar.gz or an unpacked folder),
# pip's access to PyPI for it and the wheels.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
kit=${1:?usage: scripts/gpu/prepare.sh KIT-DIR}
mkdir -p "$kit"
kit=$(cd "$kit" && pwd)
py=$repo/.venv/bin/python
[ -x "$py" ] || { echo "prepare: $repo/.venv is missing: run scripts/bootstrap.sh first" >&2; exit 1; }
cp "$here"/{run.sh,bench.py,spec_stress.py,make_model.py,daemon_toml.py} "$kit/"
# bench.py's NDJSON client: the test kit's (standard library only), found beside it.
mkdir -p "$kit/tests/kit"
cp "$repo/tests/__init__.py" "$kit/tests/"
cp "$repo"/tests/kit/{__init__,daemon,ndjson}.py "$kit/tests/kit/"
version=$(grep -o 'llama-cpp-python==[^"]*' "$repo/pyproject.toml" | cut -d= -f3)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${SDIST:-}
if [ -z "$sdist" ]; then
  (cd "$work" && "$py" -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version")
  sdist=$work/llama_cpp_python-$version.tar.gz
fi
if [ -d "$sdist" ]; then
  src=$sdist
else
  tar -C "$work" -xzf "$sdist"
  src=$work/llama_cpp_python-$version
fi
[ -d "$src/vendor/llama.cpp" ] || { echo "prepare: $src is not llama-cpp-python's sdist" >&2; exit 1; }
bash "$here/prune_src.sh" "$src" "$kit/llama-src.tar.gz"
model=$(cd "$repo" && "$py" -c "from sfcore_daemon.llama.modelfile import default_model_path as p; print(p())")
"$py" "$here/make_model.py" extract "$model" "$kit/model_meta.json.gz"
# The daemon as it is in this working tree (tracked and new files, edits included).
(cd "$repo" && git ls-files -co --exclude-standard -- sfcore_daemon server_config.toml pyproject.toml \
  | grep -v __pycache__ | tar -cf "$kit/sfcore.tar" -T -)
(cd "$repo" && echo "$(git log -1 --format='%h %s' | cut -c1-70)$(git status --porcelain sfcore_daemon | grep -q . && echo ' + uncommitted changes')") > "$kit/sfcore.rev"
rm -rf "$kit/whl"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$kit/whl" msgspec tomli-w typing_extensions
du -sh "$kit"
