#!/usr/bin/env bash
# Builds llama-cpp-python from PyPI into .venv-llama (several minutes once; kept while the
# pinned versions and this CPU's build flags stay the same), for the scripts that compare
# against llama.cpp. Pinned build: the instruction sets this CPU has, never AMX (it crashes
# in these VMs), no -march=native. Sourced or run from the repository root.
set -euo pipefail
LLAMA_CPP_VERSION="0.3.36"
GGUF_PY_VERSION="0.17.1"

flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
flags+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
has() { grep -qw "$1" /proc/cpuinfo; }
if has avx512f && has avx512bw && has avx512vl; then flags+=" -DGGML_AVX512=ON"; fi
if has avx512_vnni; then flags+=" -DGGML_AVX512_VNNI=ON"; fi
if has avx512_bf16; then flags+=" -DGGML_AVX512_BF16=ON"; fi
LLAMA_CPP_BUILD="llama-cpp-python==${LLAMA_CPP_VERSION} gguf==${GGUF_PY_VERSION} ${flags}"

if [ "$(cat .venv-llama/build-flags 2>/dev/null)" != "$LLAMA_CPP_BUILD" ] \
    || ! .venv-llama/bin/python -c "import llama_cpp" 2>/dev/null; then
    rm -rf .venv-llama
    python3 -m venv .venv-llama
    CMAKE_ARGS="$flags" .venv-llama/bin/pip install --quiet --disable-pip-version-check \
        --no-binary llama-cpp-python "llama-cpp-python==${LLAMA_CPP_VERSION}" \
        "gguf==${GGUF_PY_VERSION}"
    echo "$LLAMA_CPP_BUILD" > .venv-llama/build-flags
fi
