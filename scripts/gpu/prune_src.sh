#!/usr/bin/env bash
# Make llama-src.tar.gz from an unpacked llama-cpp-python sdist: the llama_cpp/ Python
# package and a pruned vendor/llama.cpp (CPU + CUDA backends, libs, common, vendor, tools;
# no models/docs/tests/examples/other backends/UI sources): about 7 MB instead of 76.
#   scripts/gpu/prune_src.sh UNPACKED-SDIST-DIR OUT.tar.gz
set -euo pipefail
SDIST=${1:?usage: prune_src.sh UNPACKED-SDIST-DIR OUT.tar.gz}
OUTTAR=${2:?usage: prune_src.sh UNPACKED-SDIST-DIR OUT.tar.gz}
NAME=$(basename "$SDIST")   # llama_cpp_python-<version>
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
D=$STAGE/$NAME
mkdir -p "$D/vendor"
cp -a "$SDIST/llama_cpp" "$SDIST/LICENSE.md" "$D/"
rm -rf "$D/llama_cpp/lib" "$D/llama_cpp/__pycache__"
L=$SDIST/vendor/llama.cpp
T=$D/vendor/llama.cpp
mkdir -p "$T/scripts"
for x in CMakeLists.txt LICENSE cmake ggml src include common vendor tools licenses app; do
  [ -e "$L/$x" ] && cp -a "$L/$x" "$T/"
done
cp -a "$L/scripts/ui-assets.cmake" "$T/scripts/"
# other backends' sources (only added by ggml/src/CMakeLists.txt when GGML_<X>=ON)
for b in vulkan sycl metal opencl cann musa hip webgpu rpc hexagon openvino et virtgpu zdnn zendnn kompute; do
  rm -rf "$T/ggml/src/ggml-$b"
done
# UI: keep only what CMake reads (assets are absent: server builds without embedded UI)
find "$T/tools/ui" -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name '*.in' ! -name sources.cmake -exec rm -rf {} +
rm -rf "$T/tools/server/tests" "$T/tools/server/bench" "$T/tools/mtmd/tests" \
       "$T/tools/mtmd"/test-*.jpeg "$T/tools/mtmd"/test-*.mp3 "$T/tools/mtmd"/test-*.mp4 \
       "$T/vendor/miniaudio"/*.md
find "$T" -name '*.md' -delete
find "$T" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$STAGE" -czf "$OUTTAR" "$NAME"
du -sh "$OUTTAR"
