#!/usr/bin/env bash
# Prepare the llama.cpp that lloyal builds: the pinned llama-cpp-sys-2 crate
# with the project's patches applied, in vendor/llama-cpp-sys-2 (ignored by
# git). Cargo.toml's [patch.crates-io] points llama-cpp-sys-2 there, so every
# build (cargo test, the editable install, the wheel, the benches) compiles
# the same patched source.
#
#   patches/llama.cpp/*.patch         applied in the crate's llama.cpp/ (the
#                                     diffs are upstream-relative, so each can
#                                     be proposed to ggml-org/llama.cpp as is)
#   patches/llama-cpp-sys-2/*.patch   applied at the crate's root
#
# The crate comes from cargo's registry cache (fetched with `cargo fetch` in a
# scratch project when missing) and is checked against the sha256 that
# crates.io published for it. A stamp of the version, the patches and this
# script keeps a prepared copy untouched (and cargo's fingerprints valid)
# until one of them changes. A patch that does not apply stops the script
# with git's message: nothing is built from a half-patched tree.
#
#   scripts/patch_llama.sh            prepare (no-op when up to date)
#   scripts/patch_llama.sh --check    exit 1 if the copy is missing or stale
set -euo pipefail
cd "$(dirname "$0")/.."

CRATE=llama-cpp-sys-2
# The pin and its crates.io checksum (Cargo.lock no longer records it once
# the crate is patched in). scripts/bump_llama.sh rewrites both lines.
VERSION=0.1.160
SHA256=912d8a0522acec022ae07d099366234067c8af6a18570a603f0749b7bb927e9a

DEST=vendor/$CRATE
CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}

# sha256sum (GNU) or shasum (macOS)
sha256() {
    if command -v sha256sum >/dev/null; then sha256sum "$@"; else shasum -a 256 "$@"; fi
}

stamp() {
    {
        echo "$CRATE $VERSION $SHA256"
        cat "$0"
        for p in patches/llama.cpp/*.patch patches/$CRATE/*.patch; do
            if [ -e "$p" ]; then echo "$p"; cat "$p"; fi
        done
    } | sha256 | cut -d' ' -f1
}

want=$(stamp)
have=$(cat "$DEST/.lloyal-patched" 2>/dev/null || true)
if [ "$want" = "$have" ]; then
    exit 0
fi
if [ "${1:-}" = "--check" ]; then
    echo "$DEST is missing or stale: run scripts/patch_llama.sh" >&2
    exit 1
fi

find_crate() {
    ls "$CARGO_HOME"/registry/cache/*/"$CRATE-$VERSION.crate" 2>/dev/null | head -n1
}
archive=$(find_crate)
if [ -z "$archive" ]; then
    echo "fetching $CRATE $VERSION"
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    mkdir -p "$scratch/src"
    printf '[package]\nname = "fetch-llama"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\n%s = { version = "=%s", default-features = false }\n' \
        "$CRATE" "$VERSION" > "$scratch/Cargo.toml"
    touch "$scratch/src/lib.rs"
    cargo fetch -q --manifest-path "$scratch/Cargo.toml"
    archive=$(find_crate)
fi
if [ -z "$archive" ]; then
    echo "cannot find $CRATE-$VERSION.crate in $CARGO_HOME/registry/cache" >&2
    exit 1
fi
if [ "$(sha256 "$archive" | cut -d' ' -f1)" != "$SHA256" ]; then
    echo "$archive: sha256 is not crates.io's $SHA256" >&2
    exit 1
fi

echo "preparing $DEST ($CRATE $VERSION + patches)"
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
tar -xzf "$archive" -C "$DEST.tmp" --strip-components=1
for p in patches/llama.cpp/*.patch; do
    [ -e "$p" ] || continue
    echo "  $p"
    git apply --unsafe-paths --directory="$DEST.tmp/llama.cpp" -p1 "$p"
done
for p in patches/$CRATE/*.patch; do
    [ -e "$p" ] || continue
    echo "  $p"
    git apply --unsafe-paths --directory="$DEST.tmp" -p1 "$p"
done
echo "$want" > "$DEST.tmp/.lloyal-patched"
# tar gives every file the archive's mtime, and cargo and CMake rebuild a file
# only when it is newer than their last build: a file that a patch no longer
# changes (or changes differently) must look new, or its old object stays.
if [ -d "$DEST" ]; then
    (cd "$DEST.tmp" && find . -type f ! -name .lloyal-patched) | while read -r f; do
        if ! cmp -s "$DEST.tmp/$f" "$DEST/$f"; then
            touch "$DEST.tmp/$f"
        fi
    done
fi
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
