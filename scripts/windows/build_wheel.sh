#!/usr/bin/env bash
# Build lloyal's Windows x64 wheel on this Linux machine: abi3 (CPython
# 3.10+), cross-compiled with MinGW-w64 for x86_64-pc-windows-gnu, llama.cpp's
# CPU backend built for every x86-64 level and chosen at run time (as in the
# Linux wheel: GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS), libstdc++, libgomp
# and winpthread linked statically, so the wheel needs only python3.dll and
# DLLs every Windows has.
#
#   scripts/windows/build_wheel.sh      # -> dist/lloyal-*-win_amd64.whl
#
# The tools come from scripts/windows/toolchain.sh (MinGW and Wine from
# Debian, Debian's rustc-web with its std source in a cache); Rust's std for
# the target is built from that source (-Zbuild-std). The llama.cpp and
# llama-cpp-sys-2 fixes MinGW needs are patch files in patches/, applied by
# scripts/patch_llama.sh like every other.
#
# Env: CARGO_TARGET_DIR (default ~/.cache/lloyal/target-windows), DIST
# (default dist), MATURIN (default: maturin on PATH).
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/patch_llama.sh
eval "$(scripts/windows/toolchain.sh)"

TARGET=x86_64-pc-windows-gnu
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/lloyal/target-windows}"
DIST="${DIST:-dist}"
MATURIN="${MATURIN:-maturin}"

# The baseline x86-64 for the Rust code and llama.cpp's own libraries (the
# CPU modules get their levels from GGML_CPU_ALL_VARIANTS); the C++ runtime,
# libgcc and winpthread linked into the extension, never shipped as DLLs.
# A crate that compiles C++ asks for -lstdc++, which the linker resolves to
# libstdc++.dll.a when it sits beside libstdc++.a: a folder that holds only
# the static archive, searched first, links it in.
STATIC_LIBS="$WIN_CACHE/static-libs"
mkdir -p "$STATIC_LIBS"
ln -sfn "$(x86_64-w64-mingw32-g++-posix -print-file-name=libstdc++.a)" "$STATIC_LIBS/libstdc++.a"
export RUSTFLAGS="-C target-cpu=x86-64 -C link-arg=-static-libgcc -C link-arg=-static-libstdc++ -L native=$STATIC_LIBS"
export CMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON
# The same static runtime for llama.cpp's DLLs and CPU modules, kept out of
# their exports: MinGW's ld exports every symbol of a DLL built without a
# .def file, so ggml-base.dll would export _Unwind_Resume and pthread_once
# and each CPU module linking it would define them twice. (CMake passes
# llama.cpp's own objects as an archive too, so not --exclude-libs,ALL.)
runtime=libgcc.a:libgcc_eh.a:libstdc++.a:libpthread.a:libwinpthread.a:libgomp.a:libmingwex.a
export CMAKE_SHARED_LINKER_FLAGS="-static -Wl,--exclude-libs,$runtime"
export CMAKE_MODULE_LINKER_FLAGS="$CMAKE_SHARED_LINKER_FLAGS"
export CMAKE_PROJECT_INCLUDE_BEFORE="$PWD/scripts/windows/static-openmp.cmake"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/lloyal/ccache}"

raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
"$MATURIN" build --features dynamic-backends,static-runtime --target "$TARGET" -Zbuild-std \
    --auditwheel skip -o "$raw"
python3 scripts/bundle_ggml_libs.py "$raw"/lloyal*.whl "$CARGO_TARGET_DIR/$TARGET"
mkdir -p "$DIST"
rm -f "$DIST"/lloyal*-win_amd64.whl
mv "$raw"/lloyal*.whl "$DIST"/
ls -l "$DIST"/lloyal*-win_amd64.whl
