#!/usr/bin/env bash
# Builds llama.cpp's server for an H100 / H200 (sm_90), the serving peer of docs/BENCHMARKS.md, from a llama.cpp
# source tree (a release tarball or a clone; CMake, ninja and nvcc on the PATH):
#   tools/peer/build-llama-server.sh SRC_DIR [BUILD_DIR]
# The server lands in BUILD_DIR/bin/llama-server (BUILD_DIR defaults to SRC_DIR/build-sm90). Only the server target
# is built, for one architecture, so a 16-core machine takes a few minutes.
set -euo pipefail
SRC=${1:?usage: build-llama-server.sh SRC_DIR [BUILD_DIR]}
BUILD=${2:-$SRC/build-sm90}
JOBS=${JOBS:-$(nproc)}
cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON
cmake --build "$BUILD" --target llama-server -j "$JOBS"
echo "built $BUILD/bin/llama-server"
