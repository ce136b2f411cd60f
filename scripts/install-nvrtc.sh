#!/usr/bin/env bash
# Installs NVRTC, the CUDA runtime compiler, into .venv-nvrtc/ from PyPI (no-op when present),
# so the kernel sources compile to PTX on machines without a CUDA toolkit or GPU. Prints the
# directory to put on LD_LIBRARY_PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NVRTC_VERSION="12.6.85"
lib_dir() {
    .venv-nvrtc/bin/python -c 'import nvidia.cuda_nvrtc, os; print(os.path.join(nvidia.cuda_nvrtc.__path__[0], "lib"))'
}
if ! lib_dir >/dev/null 2>&1; then
    python3 -m venv .venv-nvrtc
    .venv-nvrtc/bin/pip install --quiet --disable-pip-version-check \
        "nvidia-cuda-nvrtc-cu12==${NVRTC_VERSION}" >&2
fi
lib_dir
