#!/usr/bin/env bash
# Build llama.cpp's own C++ server (llama-server) for CPU, as a benchmark yardstick for
# scripts/bench_servers.py --llama-cpp-server. Never a dependency of xlaserve.
#
#   scripts/build_llama_cpp.sh [OUT_DIR]    # default: ~/.cache/xlaserve/llama.cpp
#
# The source is the llama.cpp vendored in the llama-cpp-python sdist on PyPI (only package
# registries need to be reachable). The last line printed is the path of the llama-server
# binary; a second run finds it and builds nothing. The binary is built for this CPU
# (GGML_NATIVE), static, and needs nothing from OUT_DIR but itself.
set -euo pipefail

VERSION=0.3.36
OUT=$(realpath -m "${1:-${XDG_CACHE_HOME:-$HOME/.cache}/xlaserve/llama.cpp}")
SRC="$OUT/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$OUT/build-$VERSION"
BIN="$BUILD/bin/llama-server"

if [[ -x "$BIN" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$OUT"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  sdist="$OUT/llama_cpp_python-$VERSION.tar.gz"
  if [[ ! -f "$sdist" ]]; then
    # The sdist alone: --no-binary for this package only, so that pip reads its metadata
    # with wheels of its build backend (with :all:, pip first builds the backend's own build
    # dependencies from source: still at it after two minutes on a 2-vCPU machine).
    python -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
      -d "$OUT" >&2
  fi
  tar -xzf "$sdist" -C "$OUT"
fi

# CPU only, no network at build or run time: no CURL (deprecated and ignored by this
# llama.cpp, kept for older trees), no OpenSSL, no web UI (the prebuilt one is downloaded
# from Hugging Face at build time). Static, so the binary does not need the build tree.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF >&2
cmake --build "$BUILD" --config Release --target llama-server -j "$(nproc)" >&2

"$BIN" --version >&2
echo "$BIN"
