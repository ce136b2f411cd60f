#!/usr/bin/env bash
# Installs the real clients the server tests drive (no-op when present):
#   .venv-test/  a Python venv with the official `openai` client (PyPI)
#   prometheus   Debian's Prometheus server (apt; needs root)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OPENAI_VERSION="3.57.0"
if ! .venv-test/bin/python -c "import openai" 2>/dev/null; then
    python3 -m venv .venv-test
    .venv-test/bin/pip install --quiet --disable-pip-version-check "openai==${OPENAI_VERSION}"
fi

if ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "error: Prometheus is missing; install Debian's \`prometheus\` package (needs root)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
        || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
fi
