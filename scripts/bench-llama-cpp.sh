#!/usr/bin/env bash
# Side-by-side engine comparison with llama.cpp on the same GGUF file and thread count. The
# machines are shared and noisy, so the two engines alternate for ROUNDS rounds in one run and
# the table reports per-round ratios and their median.
# Not part of CI: it builds llama-cpp-python from PyPI into .venv-llama (several minutes once,
# scripts/llama-cpp-venv.sh, AMX off: it crashes in these VMs).
#
#   bash scripts/bench-llama-cpp.sh [threads=2] [model=smollm2-135m] [rounds=3] [file]
# `file`: a GGUF file to run instead of the model's own, or a llama.cpp preset (q4_k_m,
# q5_k_m, q6_k, ...) to make from the model's file with llama.cpp's quantizer (requantizing,
# as users do with downloaded checkpoints) into models/derived/. Prints markdown tables (and
# the file's tensor formats) and writes target/bench-llama-cpp.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
THREADS="${1:-2}"
MODEL="${2:-smollm2-135m}"
ROUNDS="${3:-3}"
FILE="${4:-}"
bash scripts/fetch-model.sh >/dev/null
source scripts/llama-cpp-venv.sh
cargo build --release --quiet

config="config/default.toml"
gguf=$(awk -v m="$MODEL" '/^name = /{n=$3} /^path = /{if (n=="\""m"\"") {gsub(/"/,"",$3); print $3; exit}}' "$config")

.venv-llama/bin/python - "$gguf" "$THREADS" "$MODEL" "$ROUNDS" "$config" "$FILE" "$LLAMA_CPP_BUILD" <<'PY'
import collections, ctypes, json, os, statistics, subprocess, sys
import llama_cpp
from llama_cpp import llama_cpp as capi

path, threads, model, rounds, config, file, build = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7]

PRESETS = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_m": 12,
           "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}
if file in PRESETS:
    os.makedirs("models/derived", exist_ok=True)
    out = f"models/derived/{os.path.splitext(os.path.basename(path))[0]}.{file.upper()}.gguf"
    if not os.path.exists(out):
        params = capi.llama_model_quantize_default_params()
        params.ftype = PRESETS[file]
        params.allow_requantize = True
        params.nthread = threads
        rc = capi.llama_model_quantize(path.encode(), out.encode(), ctypes.byref(params))
        if rc != 0:
            sys.exit(f"llama.cpp's quantizer failed on {path} ({rc})")
    path = out
elif file:
    if not os.path.exists(file):
        sys.exit(f"{file}: no such GGUF file, and not a preset ({', '.join(PRESETS)})")
    path = file

def tensor_formats(path):
    """Matrix count per stored format, from the file's header."""
    from gguf import GGUFReader
    counts = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return dict(sorted(counts.items()))
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512,
                      n_threads=threads, n_threads_batch=threads, verbose=False)

def perf():
    """llama.cpp's own timers; they are updated when the context synchronises (on sampling)."""
    p = llama_cpp.llama_perf_context(llm.ctx)
    return p.t_eval_ms, p.n_eval, p.t_p_eval_ms, p.n_p_eval

def llama_cpp_round():
    # Decode: a 64-token context, two warm-up steps, then 32 timed single-token steps.
    llm.reset()
    llm.eval([200 + (i * 7919) % 48000 for i in range(64)])
    token = llm.sample(temp=0.0)
    for _ in range(2):
        llm.eval([token]); token = llm.sample(temp=0.0)
    t0, n0, _, _ = perf()
    for _ in range(32):
        llm.eval([token]); token = llm.sample(temp=0.0)
    t1, n1, _, _ = perf()
    # Prefill: 512 tokens in one batch from an empty context.
    llm.reset()
    _, _, p0, m0 = perf()
    llm.eval([200 + (i * 7919 + 104729) % 48000 for i in range(512)])
    llm.sample(temp=0.0)
    _, _, p1, m1 = perf()
    assert m1 - m0 == 512, (m0, m1)
    return {"decode_tokens_per_s": 1e3 * (n1 - n0) / (t1 - t0), "prefill_tokens_per_s": 512e3 / (p1 - p0)}

def tokenrouter_round():
    out = subprocess.run(["./target/release/tokenrouter", "bench", "engine", "--config", config,
                          "--model", model, "--path", path, "--weights", "stored",
                          "--threads", str(threads), "--batch", "1,2,4,8,16",
                          "--steps", "32", "--json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)

results = []
for _ in range(rounds):
    ours = tokenrouter_round()
    theirs = llama_cpp_round()
    tok = {r["batch"]: r["tokens_per_s"] for r in ours["rows"]}
    results.append({
        "tokenrouter": ours, "llama_cpp": theirs,
        "decode_b1_vs_llama_cpp": tok[1] / theirs["decode_tokens_per_s"],
        "prefill_vs_llama_cpp": ours["prefill"]["tokens_per_s"] / theirs["prefill_tokens_per_s"],
        "aggregate_b8_vs_b1": tok[8] / tok[1],
    })
median = {k: statistics.median(r[k] for r in results)
          for k in ["decode_b1_vs_llama_cpp", "prefill_vs_llama_cpp", "aggregate_b8_vs_b1"]}
formats = tensor_formats(path)
json.dump({"threads": threads, "model_file": path, "matrix_formats": formats,
           "llama_cpp_build": build, "rounds": results, "median": median},
          open("target/bench-llama-cpp.json", "w"), indent=2)

print(f"`{path}` (matrices: {', '.join(f'{n} {k}' for k, n in formats.items())}), {threads} thread(s), "
      f"{rounds} alternating rounds; llama.cpp: {build}\n")
print("| round | decode B=1 tok/s (ours / llama.cpp) | prefill 512 tok/s (ours / llama.cpp) | B=8 aggregate tok/s (ours) | B=8 / B=1 |")
print("|---:|---|---|---:|---:|")
for i, r in enumerate(results, 1):
    tok = {x["batch"]: x["tokens_per_s"] for x in r["tokenrouter"]["rows"]}
    print(f"| {i} | {tok[1]:.1f} / {r['llama_cpp']['decode_tokens_per_s']:.1f} ({r['decode_b1_vs_llama_cpp']:.2f}×) "
          f"| {r['tokenrouter']['prefill']['tokens_per_s']:.1f} / {r['llama_cpp']['prefill_tokens_per_s']:.1f} ({r['prefill_vs_llama_cpp']:.2f}×) "
          f"| {tok[8]:.1f} | {r['aggregate_b8_vs_b1']:.2f}× |")
print(f"\nmedians: decode B=1 {median['decode_b1_vs_llama_cpp']:.2f}× llama.cpp, "
      f"prefill {median['prefill_vs_llama_cpp']:.2f}× llama.cpp, B=8 aggregate {median['aggregate_b8_vs_b1']:.2f}× B=1")
bound = results[-1]["tokenrouter"].get("bound")
if bound:
    print(f"bound (last round): {bound['weight_bytes'] / 1e6:.1f} MB per step / {bound['read_gb_per_s']:.1f} GB/s "
          f"= {bound['bound_ms']:.2f} ms; our B=1 step at {100 * bound['fraction_of_bound']:.0f} % of it")
PY
