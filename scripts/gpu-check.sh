#!/usr/bin/env bash
# The GPU issue's checks as one prepared run on a lent GPU machine (the `device` tool). That
# machine has the NVIDIA driver and CUDA toolkit (NVRTC, cuBLAS) but no Rust and no network,
# and a call carries at most 64 MiB, less than the model (94 MiB). So:
#
#   here:            bash scripts/gpu-check.sh prepare
#                    (release build with --features cuda, and the model split in two, in .gpu/)
#   device call 1:   carry [".gpu/tokenrouter.gz", ".gpu/model.part-aa", ".gpu/model.sha256"]
#                    command: bash scripts/gpu-check.sh receive
#   device call 2:   carry [".gpu/model.part-ab"]  (at once: the machine must still be warm)
#                    command: bash scripts/gpu-check.sh run
#
# `run` writes into $OUT: the GPU's name, greedy parity with the CPU executor (64 tokens, 3
# prompts), `bench engine` on the GPU, and one `bench routing` ablation with both models on it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stash=/tmp/tokenrouter-gpu
model=models/SmolLM2-135M-Instruct.Q4_1.gguf

case "${1:-}" in
prepare)
    bash scripts/fetch-model.sh
    cargo build --release --features cuda
    rm -rf .gpu && mkdir -p .gpu
    strip -o .gpu/tokenrouter target/release/tokenrouter
    gzip -9 .gpu/tokenrouter
    split -n 2 "$model" .gpu/model.part-
    sha256sum "$model" | cut -d' ' -f1 > .gpu/model.sha256
    ls -l .gpu
    du -cb .gpu/tokenrouter.gz .gpu/model.part-aa | tail -1   # call 1 carries this (< 64 MiB)
    ;;
receive)
    mkdir -p "$stash"
    gunzip -c .gpu/tokenrouter.gz > "$stash/tokenrouter"
    chmod +x "$stash/tokenrouter"
    cp .gpu/model.part-aa .gpu/model.sha256 "$stash/"
    ls -l "$stash"
    ;;
run)
    cp .gpu/model.part-ab "$stash/"
    mkdir -p models
    cat "$stash"/model.part-* > "$model"
    echo "$(cat "$stash/model.sha256")  $model" | sha256sum --check
    # NVRTC and cuBLAS from the toolkit (any 12.x or 13.x: the APIs used are stable).
    nvrtc="$(find /usr/local /opt -name 'libnvrtc.so*' 2>/dev/null | head -1)"
    for dir in /usr/local/cuda/lib64 ${nvrtc:+"$(dirname "$nvrtc")"}; do
        if [ -d "$dir" ]; then export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
    done
    bin="$stash/tokenrouter"
    out="${OUT:-/tmp/gpu-check-out}"
    mkdir -p "$out"
    nvidia-smi -L | tee "$out/gpu.txt"
    # Each check runs even if an earlier one fails; the exit status says whether all passed.
    status=0
    "$bin" bench parity --model smollm2-135m --device cuda:0 --tokens 64 2>&1 \
        | tee "$out/parity.md" || status=1
    "$bin" bench engine --model smollm2-135m --device cuda:0 --batch 1,2,4,8,16,32 2>&1 \
        | tee "$out/engine-gpu.md" || status=1
    "$bin" bench routing --device cuda:0 --policy r2r --mode standard,tokenrouter \
        --concurrency 8 --requests 16 --max-tokens 32 2>&1 | tee "$out/routing-gpu.md" || status=1
    exit $status
    ;;
*)
    echo "usage: $0 prepare | receive | run   (see the comment at the top)" >&2
    exit 2
    ;;
esac
