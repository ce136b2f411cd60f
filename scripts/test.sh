#!/usr/bin/env bash
# The whole test suite, as README's quick start and .ci/run call it: fetches the real model
# (no-op when present), checks formatting and lints, then runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/fetch-model.sh
export TOKENROUTER_REQUIRE_MODEL=1
cargo fmt --check
cargo clippy --all-targets -- -D warnings
cargo test --all-targets
