#!/usr/bin/env bash
# The whole test suite, as README's quick start and .ci/run call it: fetches the real model
# and the real clients the server tests drive (no-ops when present), checks formatting and
# lints, then runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/fetch-model.sh
bash scripts/install-test-clients.sh
export TOKENROUTER_REQUIRE_MODEL=1 TOKENROUTER_REQUIRE_CLIENTS=1
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo test --all-targets
