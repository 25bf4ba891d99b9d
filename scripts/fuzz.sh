#!/usr/bin/env bash
# Run every fuzz target (crates/lloyal-core/tests/fuzz.rs) for a while:
# GGUF headers, saved KV states, the GBNF translator, chat templates.
#   scripts/fuzz.sh [seconds per target, default 600]
# CI runs the same targets for 2 s each as part of `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-600}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/lloyal/target}"
LLOYAL_FUZZ_SECONDS="$seconds" cargo test -p lloyal-core --test fuzz -- \
    --test-threads=1 --nocapture
