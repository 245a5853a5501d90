#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` (the CPU peer fdx is compared against) from the
# llama.cpp sources vendored in the PyPI sdist of llama-cpp-python, and install it to
# $PEERS/bin/llama-server.  Nothing from llama.cpp is committed to this repository.
#
# Usage:  bench/build_peer.sh            (PEERS=/opt/peers, JOBS=2, version from pip's resolver)
#         PEERS=/tmp/peers JOBS=4 LLAMA_CPP_PYTHON_VERSION=0.3.16 bench/build_peer.sh
# Runs at nice 19; takes 10-20+ minutes on 2 cores.  Logs to $PEERS/build.log when run
# with `>>"$PEERS/build.log" 2>&1` (see the compare_peers script's --help).
set -euo pipefail

PEERS="${PEERS:-/opt/peers}"
JOBS="${JOBS:-2}"
PIP="${PIP:-$(dirname "$0")/../.venv/bin/pip}"
[ -x "$PIP" ] || PIP=pip
SPEC="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"

mkdir -p "$PEERS/src" "$PEERS/bin"
echo "[build_peer] $(date -u +%FT%TZ) downloading sdist of $SPEC"
if ! ls "$PEERS"/src/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    # --no-binary for this package only: its build dependencies come as wheels (":all:"
    # would build setuptools, hatchling, scikit-build-core ... from source first, minutes)
    "$PIP" download --no-deps --no-binary llama-cpp-python "$SPEC" -d "$PEERS/src"
fi
SDIST="$(ls -1 "$PEERS"/src/llama_cpp_python-*.tar.gz | sort -V | tail -n1)"
SRCDIR="${SDIST%.tar.gz}"
if [ ! -d "$SRCDIR" ]; then
    echo "[build_peer] unpacking $SDIST"
    tar -xzf "$SDIST" -C "$PEERS/src"
fi
LLAMA="$SRCDIR/vendor/llama.cpp"
[ -f "$LLAMA/CMakeLists.txt" ] || { echo "[build_peer] no llama.cpp sources in $LLAMA" >&2; exit 1; }

GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
echo "[build_peer] configuring $LLAMA"
nice -n 19 cmake -S "$LLAMA" -B "$LLAMA/build" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
echo "[build_peer] building llama-server with -j$JOBS"
nice -n 19 cmake --build "$LLAMA/build" --target llama-server -j "$JOBS"
install -m 755 "$LLAMA/build/bin/llama-server" "$PEERS/bin/llama-server"
echo "[build_peer] $(date -u +%FT%TZ) installed $PEERS/bin/llama-server"
"$PEERS/bin/llama-server" --version 2>&1 | head -n 3 || true
