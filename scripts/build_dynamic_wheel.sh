#!/usr/bin/env bash
# Build a lloyal wheel whose llama.cpp is a set of shared libraries with
# run-time loaded compute backends (the `dynamic-backends` feature), and
# bundle those libraries into the wheel next to the extension.
#
# No CUDA toolkit is needed here: the wheel carries the CPU backend (one
# module per x86 feature level, the best one is picked at run time). To run
# on an NVIDIA GPU, drop a libggml-cuda.so built from the same llama.cpp
# source into the installed package's directory (scripts/cuda_check.sh shows
# how). See docs/gpu.md.
#
#   scripts/build_dynamic_wheel.sh            # -> dist-dl/lloyal-*.whl
#
# Env: CARGO_TARGET_DIR (default ~/.cache/lloyal/target-dl, kept apart from
# the static build's), DIST (default dist-dl), TARGET_CPU (default
# x86-64-v3: the repo's target-cpu=native would tie the Rust code and
# ggml-base to the build machine's CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/lloyal/target-dl}"
DIST="${DIST:-dist-dl}"
TARGET_CPU="${TARGET_CPU:-x86-64-v3}"

# RUSTFLAGS replaces .cargo/config.toml's target-cpu=native. $ORIGIN: the
# extension and every llama.cpp library find their siblings in the package
# directory (build.rs forwards CMAKE_* variables to llama.cpp's CMake).
export RUSTFLAGS="-C target-cpu=$TARGET_CPU -C link-arg=-Wl,-rpath,\$ORIGIN"
export CMAKE_INSTALL_RPATH='$ORIGIN'
export CMAKE_BUILD_WITH_INSTALL_RPATH=ON

rm -f "$DIST"/lloyal-*.whl
maturin build --features dynamic-backends --auditwheel skip -o "$DIST"
python3 scripts/bundle_ggml_libs.py "$DIST"/lloyal-*.whl "$CARGO_TARGET_DIR"
