#!/usr/bin/env bash
# Installs the real clients the server tests drive (no-op when present):
#   .venv-test/  a Python venv with the official `openai` client and `jsonschema` (PyPI)
#   .venv-torch/ torch, safetensors and numpy (PyPI), to write router checkpoints the way their
#                authors do for scripts/convert-router.py's test; PyPI's Linux torch is the
#                CUDA build (~5 GB with its nvidia-* wheels, ~3.5 min here) and runs on a CPU
#   prometheus   Debian's Prometheus server (apt; needs root)
#   nats-server  Debian's NATS server, the bus of the multi-process tests (apt; needs root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OPENAI_VERSION="3.57.0"
if ! .venv-test/bin/python -c "import openai, jsonschema" 2>/dev/null; then
    python3 -m venv .venv-test
    .venv-test/bin/pip install --quiet --disable-pip-version-check "openai==${OPENAI_VERSION}" "jsonschema==4.25.1"
fi

TORCH_VERSION="2.15.0"
if ! .venv-torch/bin/python -c "import torch, safetensors, numpy" 2>/dev/null; then
    python3 -m venv .venv-torch
    .venv-torch/bin/pip install --quiet --disable-pip-version-check \
        "torch==${TORCH_VERSION}" "safetensors==0.8.0" "numpy==2.4.6"
fi

# Installs Debian package $2 unless command $1 exists.
apt_install() {
    command -v "$1" >/dev/null && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "error: $1 is missing; install Debian's \`$2\` package (needs root)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$2" >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$2" >/dev/null; }
}
apt_install prometheus prometheus
apt_install nats-server nats-server
