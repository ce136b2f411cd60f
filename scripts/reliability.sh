#!/usr/bin/env bash
# Produces docs/reliability.md (and docs/plots/reliability/soak.svg): the real CPU pair under
# load through the HTTP API, in two parts.
#  1. A soak: `tokenrouter serve` (release) with an executor panic injected every FAULT_EVERY
#     steps per model and a KV budget of SOAK_KV_TOKENS per model (small enough that the
#     prefix cache refills to it between panics, which clear it), driven by `tokenrouter
#     bench load` for DURATION_S seconds (or REQUESTS requests when DURATION_S=0) with random
#     client disconnects and policy swaps, sampling the server's memory, descriptors, KV and
#     latency every SAMPLE_EVERY_S; then SIGTERM.
#  2. Slow clients: a fresh server without faults; a normal load (SLOW_CONCURRENCY clients,
#     SLOW_MAX_TOKENS tokens, the default policy) measured alone and beside IDLE_CLIENTS idle
#     and SLOW_CLIENTS slow-loris connections, SLOW_ROUNDS rounds.
# Not part of CI (the defaults, the reliability acceptance, run for over an hour).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DURATION_S="${DURATION_S:-3600}"
REQUESTS="${REQUESTS:-2000}"
CONCURRENCY="${CONCURRENCY:-64}"
MAX_TOKENS="${MAX_TOKENS:-8}"
FAULT_EVERY="${FAULT_EVERY:-500}"
SOAK_KV_TOKENS="${SOAK_KV_TOKENS:-16384}"
SAMPLE_EVERY_S="${SAMPLE_EVERY_S:-30}"
IDLE_CLIENTS="${IDLE_CLIENTS:-1000}"
SLOW_CLIENTS="${SLOW_CLIENTS:-200}"
SLOW_CONCURRENCY="${SLOW_CONCURRENCY:-8}"
SLOW_MAX_TOKENS="${SLOW_MAX_TOKENS:-16}"
SLOW_REQUESTS="${SLOW_REQUESTS:-200}"
SLOW_ROUNDS="${SLOW_ROUNDS:-3}"
PORT="${PORT:-18480}"
export TOKENROUTER_ADMIN_TOKEN="${TOKENROUTER_ADMIN_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
# Every connection is a descriptor on both ends: the slow clients need more than the usual
# soft limit of 1024 (the server's `max_connections` is 2048 per worker, 2 workers).
ulimit -n 16384

bash scripts/fetch-model.sh
cargo build --release --quiet
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

start_server() { # config, log
    ./target/release/tokenrouter serve --config "$1" --port "$PORT" 2> "$2" &
    server=$!
    for _ in $(seq 1 120); do grep -q "listening on" "$2" && return; sleep 1; done
    echo "the server did not start: $(cat "$2")" >&2
    exit 1
}

# 1. The soak.
sed -e "s/^threads = 1$/threads = 1\nfault_every_steps = ${FAULT_EVERY}/" \
    -e "s/^kv_tokens = .*/kv_tokens = ${SOAK_KV_TOKENS}/" config/default.toml > "$work/faulty.toml"
start_server "$work/faulty.toml" "$work/server.log"
if [ "$DURATION_S" = 0 ]; then
    size=(--requests "$REQUESTS"); what="REQUESTS=${REQUESTS}"
else
    size=(--duration-s "$DURATION_S"); what="DURATION_S=${DURATION_S}"
fi
soak_command="tokenrouter bench load ${size[*]} --concurrency ${CONCURRENCY} --max-tokens ${MAX_TOKENS} --disconnect 0.1 --swap-every-s 10 --sample-every-s ${SAMPLE_EVERY_S} --server-pid PID --out docs/plots/reliability"
started=$(date +%s)
set +e
./target/release/tokenrouter bench load --url "http://127.0.0.1:${PORT}" "${size[@]}" \
    --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --disconnect 0.1 --swap-every-s 10 \
    --sample-every-s "$SAMPLE_EVERY_S" --server-pid "$server" --out docs/plots/reliability \
    > "$work/soak.md"
soak_status=$?
kill -TERM "$server"
wait "$server"
server_status=$?
set -e
elapsed=$(( $(date +%s) - started ))
token_leaks=$(grep -c "$TOKENROUTER_ADMIN_TOKEN" "$work/server.log" || true)

# 2. Slow and idle clients beside a normal load.
start_server config/default.toml "$work/slow-server.log"
slow_command="tokenrouter bench load --requests ${SLOW_REQUESTS} --concurrency ${SLOW_CONCURRENCY} --max-tokens ${SLOW_MAX_TOKENS} --disconnect 0 --swap-policies '' --idle-clients ${IDLE_CLIENTS} --slow-clients ${SLOW_CLIENTS} --rounds ${SLOW_ROUNDS}"
set +e
./target/release/tokenrouter bench load --url "http://127.0.0.1:${PORT}" --requests "$SLOW_REQUESTS" \
    --concurrency "$SLOW_CONCURRENCY" --max-tokens "$SLOW_MAX_TOKENS" --disconnect 0 \
    --swap-policies '' --idle-clients "$IDLE_CLIENTS" --slow-clients "$SLOW_CLIENTS" \
    --rounds "$SLOW_ROUNDS" > "$work/slow.md"
slow_status=$?
kill -TERM "$server"
wait "$server"
slow_server_status=$?
set -e

{
    echo "# Reliability under load"
    echo
    echo "Produced by \`bash scripts/reliability.sh\` (${what} CONCURRENCY=${CONCURRENCY}"
    echo "MAX_TOKENS=${MAX_TOKENS} FAULT_EVERY=${FAULT_EVERY} SOAK_KV_TOKENS=${SOAK_KV_TOKENS} SAMPLE_EVERY_S=${SAMPLE_EVERY_S};"
    echo "IDLE_CLIENTS=${IDLE_CLIENTS} SLOW_CLIENTS=${SLOW_CLIENTS} SLOW_CONCURRENCY=${SLOW_CONCURRENCY}"
    echo "SLOW_MAX_TOKENS=${SLOW_MAX_TOKENS} SLOW_REQUESTS=${SLOW_REQUESTS} SLOW_ROUNDS=${SLOW_ROUNDS})"
    echo "on $(date -u +%Y-%m-%d), $(nproc) cores, the real CPU pair (config/default.toml), the"
    echo "server and the load tool on one host with \`ulimit -n 16384\`."
    echo
    echo "## Soak"
    echo
    echo "\`${soak_command}\` against \`tokenrouter serve\` with an executor panic injected every"
    echo "${FAULT_EVERY} steps of each model and \`kv_tokens = ${SOAK_KV_TOKENS}\` per model (a panic clears"
    echo "the prefix cache; at the shipped 65536 it would not refill to its cap between panics, and"
    echo "a KV block's memory, once touched, is kept for reuse, so memory would keep rising towards"
    echo "that cap): 10 % random client disconnects (streams dropped after"
    echo "their first event, whole answers abandoned after 50 ms), the default policy swapped"
    echo "every 10 s between me, r2r and citer, the prefix cache on; then SIGTERM. A request"
    echo "resident on a model when its panic fires fails cleanly (HTTP 500 or an error event in"
    echo "its stream); the model restarts and the rest continue. Memory passes when it ends within"
    echo "5 % of its value once the prefix cache has reached its cap (the first sample after 5"
    echo "minutes with KV in use and cached at ≥ 98 % of the budget; without one, the first after"
    echo "5 minutes);"
    echo "descriptors when they return to their count before the load. Plot:"
    echo "[soak.svg](plots/reliability/soak.svg)."
    echo
    cat "$work/soak.md"
    echo
    echo "Load tool exit status: ${soak_status} (0 = nothing hung or lost, KV back to 0, healthy,"
    echo "memory and descriptors within their limits). Server exit status after SIGTERM:"
    echo "${server_status}. Wall time: ${elapsed} s. The admin token was generated for the run and"
    echo "never printed; the server log does not contain it: ${token_leaks} occurrences."
    echo
    echo "## Slow and idle clients"
    echo
    echo "\`${slow_command}\` against \`tokenrouter serve\` with the shipped \`[server]\`"
    echo "settings: idle connections are closed by \`header_timeout_ms\` (5 s; they reconnect at"
    echo "once), slow-loris ones likewise (a header byte a second never completes the headers);"
    echo "\`max_connections\` (2048 per worker, 2 workers) and the descriptor limit leave room for"
    echo "them beside the normal load. Each round measures the normal load alone, then beside"
    echo "the slow connections (after 3 s of them)."
    echo
    cat "$work/slow.md"
    echo
    echo "Load tool exit status: ${slow_status}; server exit status after SIGTERM: ${slow_server_status}."
} > docs/reliability.md
cat docs/reliability.md
[ "$soak_status" = 0 ] && [ "$server_status" = 0 ] && [ "$slow_status" = 0 ] && [ "$slow_server_status" = 0 ]
