#!/usr/bin/env bash
# Build llama-cpp-python (pinned) from PyPI's source distribution into an ignored folder, as a
# peer to benchmark against (not a dependency of swiftspec-mpi). Idempotent: a finished build
# is reused. Usage: benchmarks/build_llama_cpp.sh [DEST]   (default .cache/llama_cpp)
#   DEST/venv/bin/python -c "import llama_cpp" works afterwards.
# On 2 cores the build takes 20-40 minutes; run it under `nice` beside other work.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.16}
DEST=${1:-.cache/llama_cpp}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
if [ -x "$DEST/venv/bin/python" ] && "$DEST/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    echo "llama-cpp-python already built in $DEST/venv"; exit 0
fi
test -x "$DEST/venv/bin/python" || python3 -m venv --system-site-packages "$DEST/venv"
"$DEST/venv/bin/pip" download -q --no-deps --no-binary :all: -d "$DEST/sdist" "llama-cpp-python==$VERSION"
# Native build for this CPU (AVX2/FMA), no GPU backends, no OpenMP clash with torch's.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
"$DEST/venv/bin/pip" install -q --no-deps "$DEST"/sdist/llama_cpp_python-$VERSION.tar.gz
"$DEST/venv/bin/pip" install -q diskcache jinja2 2>/dev/null || true
"$DEST/venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
