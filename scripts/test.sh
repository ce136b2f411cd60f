#!/usr/bin/env bash
# The whole test suite, as README's quick start and .ci/run call it: fetches the real models,
# the real clients the server tests drive and NVRTC (no-ops when present), checks formatting
# and lints (with and without the `cuda` feature), then runs every test, and the GPU backend's
# tests with `--features cuda` (kernel sources compile with NVRTC; GPU tests skip without one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/fetch-model.sh
bash scripts/fetch-gemma3.sh
bash scripts/install-test-clients.sh
NVRTC_LIB="$(bash scripts/install-nvrtc.sh)"
export TOKENROUTER_REQUIRE_MODEL=1 TOKENROUTER_REQUIRE_CLIENTS=1 TOKENROUTER_REQUIRE_NVRTC=1
# A clean clone gains nothing from incremental caches, which took ~10 GB of its disk.
export CARGO_INCREMENTAL=0
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo clippy --features cuda --all-targets -- -D warnings
cargo build --features cuda
cargo test --all-targets
LD_LIBRARY_PATH="${NVRTC_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" cargo test --features cuda --lib --test cuda
