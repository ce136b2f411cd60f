#!/usr/bin/env bash
# Produces docs/reliability.md: the real CPU pair under load with faults, through the HTTP API.
# Starts `tokenrouter serve` (release) with an executor panic injected every FAULT_EVERY steps
# per model, drives it with `tokenrouter bench load` (random client disconnects, policy swaps),
# checks nothing hung or was lost and no KV is held, then SIGTERMs the server and checks it
# exits 0. Not part of CI (it runs for minutes). Scale with REQUESTS / CONCURRENCY / MAX_TOKENS.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

REQUESTS="${REQUESTS:-2000}"
CONCURRENCY="${CONCURRENCY:-32}"
MAX_TOKENS="${MAX_TOKENS:-8}"
FAULT_EVERY="${FAULT_EVERY:-500}"
PORT="${PORT:-18480}"
export TOKENROUTER_ADMIN_TOKEN="${TOKENROUTER_ADMIN_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}"

bash scripts/fetch-model.sh
cargo build --release --quiet
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sed "s/^threads = 1$/threads = 1\nfault_every_steps = ${FAULT_EVERY}/" config/default.toml > "$work/faulty.toml"
./target/release/tokenrouter serve --config "$work/faulty.toml" --port "$PORT" 2> "$work/server.log" &
server=$!
for _ in $(seq 1 120); do grep -q "listening on" "$work/server.log" && break; sleep 1; done

started=$(date +%s)
set +e
./target/release/tokenrouter bench load --url "http://127.0.0.1:${PORT}" --requests "$REQUESTS" \
    --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --disconnect 0.1 --swap-every-s 10 \
    > "$work/report.md"
load_status=$?
kill -TERM "$server"
wait "$server"
server_status=$?
set -e
elapsed=$(( $(date +%s) - started ))

{
    echo "# Reliability under load"
    echo
    echo "Produced by \`bash scripts/reliability.sh\` (REQUESTS=${REQUESTS} CONCURRENCY=${CONCURRENCY}"
    echo "MAX_TOKENS=${MAX_TOKENS} FAULT_EVERY=${FAULT_EVERY}) on $(date -u +%Y-%m-%d), $(nproc) cores:"
    echo "the real CPU pair (config/default.toml) with an executor panic injected every"
    echo "${FAULT_EVERY} steps of each model, \`tokenrouter bench load\` over loopback with 10 % random"
    echo "client disconnects (streams dropped after their first event, whole answers abandoned"
    echo "after 50 ms) and the default policy swapped every 10 s between me, r2r and citer; then"
    echo "SIGTERM. A request resident on a model when its panic fires fails cleanly (HTTP 500 or an"
    echo "error event in its stream); the model restarts and the rest continue."
    echo
    cat "$work/report.md"
    echo
    echo "Load tool exit status: ${load_status} (0 = nothing hung or lost, KV back to 0, healthy)."
    echo "Server exit status after SIGTERM: ${server_status}. Wall time: ${elapsed} s."
    echo "The admin token was generated for the run and never printed; the server log does not contain it: $(grep -c "$TOKENROUTER_ADMIN_TOKEN" "$work/server.log" || true) occurrences."
} > docs/reliability.md
cat docs/reliability.md
[ "$load_status" = 0 ] && [ "$server_status" = 0 ]
