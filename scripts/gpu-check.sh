#!/usr/bin/env bash
# The GPU issue's checks as one prepared run on a lent GPU machine (the `device` tool). That
# machine has the NVIDIA driver and a CUDA toolkit (NVRTC, cuBLAS) but no Rust and no network,
# and a call carries at most 64 MiB, less than the binaries and the model (94 MiB) together. So:
#
#   here:            bash scripts/gpu-check.sh prepare
#                    (release builds with --features cuda: the binary and the GPU test binary,
#                    and the model split in two, in .gpu/; it prints the two calls' carry lists)
#   device call 1:   carry [".gpu/tokenrouter.gz", ".gpu/cuda-tests.gz", ".gpu/model.part-aa",
#                           ".gpu/model.sha256"]
#                    command: bash scripts/gpu-check.sh receive
#                    (unpacks, then runs tests/cuda.rs on the GPU: tiny models in every weight
#                    format against the CPU, graph replay == eager steps, batched ==
#                    unbatched, forks, KV back to 0)
#   device call 2:   carry [".gpu/model.part-ab"]  (at once: a machine stays warm for 30 s)
#                    command: bash scripts/gpu-check.sh run
#                    (the real model: parity with the CPU (f32), `bench engine` B = 1…64 with
#                    CUDA graphs on and off, in Q4_1 and bf16, and the GPU pair's two models
#                    stepping beside each other; or, with `formats` instead of `run`,
#                    `bench engine` in every weight format)
#   device call 3:   nothing to carry (the warm machine keeps the model), command:
#                    bash scripts/gpu-check.sh pair
#                    (config/gpu-pair.toml: `bench pair`, then `bench routing` against the LLM
#                    alone)
#
# Every check runs even if an earlier one fails; the exit status says whether all passed. The
# reports land in $OUT (the device tool brings them back) or /tmp/gpu-check-out.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stash=/tmp/tokenrouter-gpu
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
out="${OUT:-/tmp/gpu-check-out}"
# What one call may carry (64 MiB with the working tree), less a margin of 1 MiB.
carry_limit=$((63 * 1024 * 1024))

# NVRTC and cuBLAS from the toolkit (12.x or 13.x: the APIs used are stable). cudarc opens
# `libnvrtc.so` / `libcublas.so` or the `.so.12` names, so a toolkit that only has `.so.13`
# (the pip wheels) gets links under those names in $stash/lib.
libraries() {
    mkdir -p "$stash/lib"
    local lib found
    for lib in nvrtc cublas cublasLt; do
        found="$(find /usr/local/cuda/lib64/ /usr/local/cuda*/ /opt /usr/lib -name "lib$lib.so*" \
            2>/dev/null | head -1 || true)"
        if [ -z "$found" ]; then
            echo "lib$lib.so not found" >&2
            continue
        fi
        export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        [ -e "$(dirname "$found")/lib$lib.so" ] || ln -sf "$found" "$stash/lib/lib$lib.so"
    done
    export LD_LIBRARY_PATH="$stash/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}

case "${1:-}" in
prepare)
    bash scripts/fetch-model.sh
    cargo build --release --features cuda
    tests="$(cargo test --release --features cuda --test cuda --no-run --message-format=json \
        | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' | tail -1)"
    rm -rf .gpu && mkdir -p .gpu
    strip -o .gpu/tokenrouter target/release/tokenrouter
    strip -o .gpu/cuda-tests "$tests"
    gzip -9 .gpu/tokenrouter .gpu/cuda-tests
    tree_bytes="$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)"
    binaries="$(du -cb .gpu/tokenrouter.gz .gpu/cuda-tests.gz | tail -1 | cut -f1)"
    first=$((carry_limit - tree_bytes - binaries))
    model_bytes="$(stat -c %s "$model")"
    if [ "$first" -le $((model_bytes - carry_limit + tree_bytes)) ]; then
        echo "the binaries ($binaries bytes) leave too little room for half the model" >&2
        exit 1
    fi
    head -c "$first" "$model" > .gpu/model.part-aa
    tail -c +$((first + 1)) "$model" > .gpu/model.part-ab
    sha256sum "$model" | cut -d' ' -f1 > .gpu/model.sha256
    ls -l .gpu
    echo 'call 1 carry: [".gpu/tokenrouter.gz", ".gpu/cuda-tests.gz", ".gpu/model.part-aa", ".gpu/model.sha256"]'
    echo 'call 2 carry: [".gpu/model.part-ab"]'
    ;;
receive)
    rm -rf "$stash" && mkdir -p "$stash" "$out"
    gunzip -c .gpu/tokenrouter.gz > "$stash/tokenrouter"
    gunzip -c .gpu/cuda-tests.gz > "$stash/cuda-tests"
    chmod +x "$stash/tokenrouter" "$stash/cuda-tests"
    cp .gpu/model.part-aa .gpu/model.sha256 "$stash/"
    {
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        ls -d /usr/local/cuda*/
        lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-400
    } 2>&1 | tee "$out/gpu.txt" || true
    libraries | tee -a "$out/gpu.txt"
    set +e
    TOKENROUTER_REQUIRE_GPU=1 TOKENROUTER_REQUIRE_NVRTC=1 "$stash/cuda-tests" --test-threads=1 \
        --nocapture 2>&1 | tee "$out/cuda-tests.txt"
    status=${PIPESTATUS[0]}
    echo "cuda tests exit status $status" | tee -a "$out/cuda-tests.txt"
    exit "$status"
    ;;
run | formats | pair)
    [ -x "$stash/tokenrouter" ] || {
        echo "nothing received: this is a fresh machine; run call 1 (receive) first" >&2
        exit 3
    }
    mkdir -p models "$out"
    [ -f .gpu/model.part-ab ] && cp .gpu/model.part-ab "$stash/"
    if ! echo "$(cat "$stash/model.sha256")  $model" | sha256sum --check --status 2>/dev/null; then
        [ -f "$stash/model.part-ab" ] || {
            echo "the model's second half was not carried (.gpu/model.part-ab)" >&2
            exit 3
        }
        cat "$stash"/model.part-* > "$model"
        echo "$(cat "$stash/model.sha256")  $model" | sha256sum --check
    fi
    libraries > /dev/null
    bin="$stash/tokenrouter"
    status=0
    if [ "$1" = formats ]; then
        # Instead of `run`: the real model's step times on the GPU in every weight format it
        # can be requantized to at load (K-quants fall back where 256 does not divide a width).
        report="$out/engine-gpu-formats.md"
        for weights in stored q8_0 q4_0 q5_0 q5_1 q4_k q5_k q6_k f16 bf16 f32; do
            echo "weights = $weights" >> "$report"
            timeout 60 "$bin" bench engine --model smollm2-135m --device cuda:0 \
                --weights "$weights" --batch 1,8,64 >> "$report" 2>&1 || status=1
        done
        grep -v ' INFO ' "$report"
        exit $status
    fi
    if [ "$1" = pair ]; then
        # Instead of `run`: the GPU pair's agreement and step-cost ratio, then routing against
        # the LLM alone, priced by step profiles measured on the GPU around every cell.
        # Beside the shipped SLM, the same layers in Q8_0 (more agreement on the CPU: 59.0 %
        # against 49.3 % over 144 positions; whether it costs more on a GPU is the question).
        {
            cat config/gpu-pair.toml
            printf '\n[[models]]\nname = "smollm2-135m-skip7-q8_0"\npath = "%s"\n' "$model"
            printf 'device = "cuda:0"\nweights = "q8_0"\nlayers = "0-11,19-29"\n'
        } > "$stash/gpu-pair-candidates.toml"
        timeout 90 "$bin" bench pair --config "$stash/gpu-pair-candidates.toml" \
            --model smollm2-135m-skip7-q4_0,smollm2-135m-skip7-q8_0 \
            --reference smollm2-135m-bf16 2>&1 | tee "$out/pair-gpu.md" || status=1
        timeout 300 "$bin" bench routing --config config/gpu-pair.toml --device cuda:0 \
            --policy r2r --concurrency 8 --workload long --max-tokens 64 --requests 32 \
            --rounds 2 --mode tokenrouter,async,llm-only --profile-steps 2>&1 \
            | tee "$out/routing-gpu.md" || status=1
        exit $status
    fi
    # The gate: the real model dequantized to f32 on both sides. Each step has its own time
    # limit, so one hang cannot take the call's device time.
    timeout 120 "$bin" bench parity --config config/dense-pair.toml --model smollm2-135m-f32 \
        --device cuda:0 --tokens 64 2>&1 | tee "$out/parity.md" || status=1
    # Decode steps replayed as CUDA graphs beside the same steps launched kernel by kernel.
    timeout 120 "$bin" bench engine --model smollm2-135m --device cuda:0 --cuda-graphs on,off \
        --batch 1,2,4,8,16,32,64 2>&1 | tee "$out/engine-gpu.md" || status=1
    timeout 90 "$bin" bench engine --model smollm2-135m --device cuda:0 --weights bf16 \
        --cuda-graphs on,off --batch 1,8,64 2>&1 | tee "$out/engine-gpu-bf16.md" || status=1
    # The GPU pair's models: each one's step alone, alternating with the other, and beside it
    # on its own stream.
    timeout 90 "$bin" bench engine --config config/gpu-pair.toml --model smollm2-135m-bf16 \
        --concurrent-with smollm2-135m-skip7-q4_0 --device cuda:0 --batch 1,8 2>&1 \
        | tee "$out/engine-gpu-concurrent.md" || status=1
    # The same with the SLM's stream at high priority.
    sed '/^name = "smollm2-135m-skip7-q4_0"/a stream_priority = "high"' config/gpu-pair.toml \
        > "$stash/gpu-pair-priority.toml"
    timeout 90 "$bin" bench engine --config "$stash/gpu-pair-priority.toml" \
        --model smollm2-135m-bf16 --concurrent-with smollm2-135m-skip7-q4_0 --device cuda:0 \
        --batch 1,8 2>&1 | tee "$out/engine-gpu-concurrent-priority.md" || status=1
    exit $status
    ;;
*)
    echo "usage: $0 prepare | receive | run | formats | pair   (see the comment at the top)" >&2
    exit 2
    ;;
esac
