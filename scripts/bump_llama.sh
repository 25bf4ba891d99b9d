#!/usr/bin/env bash
# Move lloyal to another llama-cpp-2 / llama-cpp-sys-2 release (and so another
# llama.cpp) in one command:
#
#   scripts/bump_llama.sh NEW_VERSION [--no-bench] [--no-test]
#
# 1. measures the current pin (bench/decode.py and bench/kv_streams.py, both
#    test models) into bench/out/bump-OLD.txt;
# 2. fetches NEW_VERSION of both crates, checks the new llama-cpp-sys-2
#    crate's sha256 and writes it with the version into scripts/
#    patch_llama.sh, the pins into Cargo.toml, and updates Cargo.lock;
# 3. re-applies patches/ (scripts/patch_llama.sh): a patch that no longer
#    applies stops here with git's message, and the pins are put back;
# 4. runs the test suite (`make test`) and the same benches into
#    bench/out/bump-NEW.txt, and prints both files side by side.
#
# It commits nothing: review the diff, refresh a patch that stopped applying
# (patches/README.md), and commit.
set -euo pipefail
cd "$(dirname "$0")/.."

NEW=${1:?usage: scripts/bump_llama.sh NEW_VERSION [--no-bench] [--no-test]}
shift
BENCH=1
TEST=1
for arg in "$@"; do
    case "$arg" in
        --no-bench) BENCH=0 ;;
        --no-test) TEST=0 ;;
        *) echo "unknown option $arg" >&2; exit 2 ;;
    esac
done

OLD=$(sed -n 's/^VERSION=//p' scripts/patch_llama.sh)
if [ "$OLD" = "$NEW" ]; then
    echo "already at $NEW" >&2
    exit 0
fi
PY=.venv/bin/python
mkdir -p bench/out

bench() {
    local out=$1
    : > "$out"
    for model in smollm2 gemma3; do
        "$PY" bench/decode.py --model "$model" --runs 3 --gen 64 | tee -a "$out"
        "$PY" bench/kv_streams.py --model "$model" --clients 8,64 --steps 48 --runs 2 \
            --layouts split,patched | tee -a "$out"
    done
}

if [ "$BENCH" = 1 ]; then
    make dev >/dev/null
    echo "== llama-cpp-2 $OLD: benches"
    bench "bench/out/bump-$OLD.txt"
fi

echo "== fetching llama-cpp-2 / llama-cpp-sys-2 $NEW"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/src"
touch "$scratch/src/lib.rs"
cat > "$scratch/Cargo.toml" <<TOML
[package]
name = "fetch-llama"
version = "0.0.0"
edition = "2021"
[dependencies]
llama-cpp-2 = { version = "=$NEW", default-features = false }
llama-cpp-sys-2 = { version = "=$NEW", default-features = false }
TOML
cargo fetch -q --manifest-path "$scratch/Cargo.toml"
archive=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"llama-cpp-sys-2-$NEW.crate" | head -n1)
# crates.io's checksum, as cargo recorded it in the scratch lock file
sha=$(awk -v v="$NEW" '/^name = "llama-cpp-sys-2"$/ {n=1; next}
    n && /^version/ {ok = ($3 == "\"" v "\""); next}
    n && ok && /^checksum/ {gsub(/"/, "", $3); print $3; exit}' "$scratch/Cargo.lock")
got=$(sha256sum "$archive" | cut -d' ' -f1)
if [ -z "$sha" ] || [ "$sha" != "$got" ]; then
    echo "checksum of $archive ($got) is not the registry's ($sha)" >&2
    exit 1
fi

cp Cargo.toml "$scratch/Cargo.toml.keep"
cp Cargo.lock "$scratch/Cargo.lock.keep"
cp scripts/patch_llama.sh "$scratch/patch_llama.sh.keep"
restore() {
    cp "$scratch/Cargo.toml.keep" Cargo.toml
    cp "$scratch/Cargo.lock.keep" Cargo.lock
    cp "$scratch/patch_llama.sh.keep" scripts/patch_llama.sh
    scripts/patch_llama.sh || true
}
sed -i -E "s/^(llama-cpp-2 = \{ version = \")=[0-9.]+/\1=$NEW/; s/^(llama-cpp-sys-2 = \{ version = \")=[0-9.]+/\1=$NEW/" Cargo.toml
sed -i -E "s/^VERSION=.*/VERSION=$NEW/; s/^SHA256=.*/SHA256=$sha/" scripts/patch_llama.sh

echo "== applying patches/ to $NEW"
if ! scripts/patch_llama.sh; then
    echo "a patch does not apply to llama-cpp-sys-2 $NEW: refresh it (patches/README.md); pins put back" >&2
    restore
    exit 1
fi
cargo update -q -p llama-cpp-2 -p llama-cpp-sys-2

if [ "$TEST" = 1 ]; then
    echo "== llama-cpp-2 $NEW: make test"
    make test
fi
if [ "$BENCH" = 1 ]; then
    make dev >/dev/null
    echo "== llama-cpp-2 $NEW: benches"
    bench "bench/out/bump-$NEW.txt"
    echo "== before ($OLD) | after ($NEW)"
    paste -d'|' "bench/out/bump-$OLD.txt" "bench/out/bump-$NEW.txt"
fi
echo "moved to llama-cpp-2 $NEW: review git diff, update CHANGELOG, commit"
