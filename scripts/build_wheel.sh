#!/usr/bin/env bash
# Build lloyal's portable Linux wheel: abi3 (CPython 3.10+), manylinux,
# llama.cpp as shared libraries whose CPU backend is compiled once per
# x86-64 level (x64, sse42, sandybridge, haswell, skylakex, icelake, zen4,
# ...; on aarch64 one per ARM feature set) and chosen at run time by
# llama.cpp (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, the `dynamic-backends`
# feature). The Rust code and llama.cpp's own libraries are compiled for the
# architecture's baseline, never for the build machine's CPU.
#
#   scripts/build_wheel.sh            # -> dist/lloyal-*.whl (needs maturin,
#                                     #    auditwheel, patchelf on PATH)
#
# Steps: maturin builds the extension; scripts/bundle_ggml_libs.py puts
# llama.cpp's libraries and CPU modules beside it (the modules are loaded
# with dlopen, which auditwheel cannot see); auditwheel repair then bundles
# what is left outside (libgomp), rewrites RPATHs and picks the manylinux
# tag from the symbols the binaries use.
#
# Env: CARGO_TARGET_DIR (default ~/.cache/lloyal/target-wheel, apart from the
# native build's so neither invalidates the other), DIST (default dist),
# TARGET_CPU (default x86-64 on x86_64, generic on aarch64),
# CARGO_BUILD_TARGET (cross builds, e.g. aarch64-unknown-linux-gnu),
# PLAT (auditwheel's --plat; default: the oldest manylinux the binaries allow),
# CUDA=1 (also build llama.cpp's CUDA backend as one more run-time module,
# libggml-cuda.so; needs the CUDA toolkit; CMAKE_CUDA_ARCHITECTURES picks the
# GPUs. The CUDA runtime libraries are not bundled: they come from the
# machine's CUDA install, see docs/gpu.md),
# VULKAN=1 (also build llama.cpp's Vulkan backend, libggml-vulkan.so, with
# scripts/build_vulkan_module.sh; the Vulkan loader, libvulkan.so.1, and the
# GPU's driver come from the machine, and where they are missing llama.cpp
# skips the module).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/patch_llama.sh

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/lloyal/target-wheel}"
DIST="${DIST:-dist}"
ARCH="${CARGO_BUILD_TARGET:-$(uname -m)}"
ARCH="${ARCH%%-*}"
case "$ARCH" in
    x86_64) TARGET_CPU="${TARGET_CPU:-x86-64}" ;;
    aarch64) TARGET_CPU="${TARGET_CPU:-generic}" ;;
    *) echo "build_wheel.sh: unsupported architecture $ARCH" >&2; exit 2 ;;
esac

# RUSTFLAGS replaces .cargo/config.toml's target-cpu=native; llama-cpp-sys-2
# passes the same -march to llama.cpp's C/C++ (GGML_NATIVE=OFF). $ORIGIN: the
# extension and every llama.cpp library find their siblings in the package
# directory (llama-cpp-sys-2 forwards CMAKE_* variables to llama.cpp's CMake).
export RUSTFLAGS="-C target-cpu=$TARGET_CPU -C link-arg=-Wl,-rpath,\$ORIGIN"
export CMAKE_INSTALL_RPATH='$ORIGIN'
export CMAKE_BUILD_WITH_INSTALL_RPATH=ON
# llama.cpp's common library (lloyal uses its JSON-schema converter) links
# cpp-httplib, which links OpenSSL when it finds it: lloyal never downloads
# anything, and a wheel that bundles OpenSSL must track its security fixes.
export CMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON

# llama-cpp-sys-2 hard-links its libraries into the target dir unless they
# exist; a rebuild after `cargo clean -p llama-cpp-sys-2` finds dangling
# symlinks there (libllama.so -> libllama.so.0) and fails. Drop them.
find "$CARGO_TARGET_DIR" -maxdepth 3 -name 'lib*.so*' -xtype l -delete 2>/dev/null || true

raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
FEATURES=dynamic-backends
EXCLUDE=()
if [ "${CUDA:-0}" = 1 ]; then
    FEATURES="$FEATURES,cuda"
    for lib in libcuda.so.1 libcudart.so.12 libcublas.so.12 libcublasLt.so.12 \
        libcudart.so.13 libcublas.so.13 libcublasLt.so.13; do
        EXCLUDE+=(--exclude "$lib")
    done
fi
MODULES=()
if [ "${VULKAN:-0}" = 1 ]; then
    scripts/build_vulkan_module.sh "$raw/modules"
    MODULES+=("$raw/modules/libggml-vulkan.so")
    EXCLUDE+=(--exclude libvulkan.so.1)
fi
maturin build --features "$FEATURES" --auditwheel skip -o "$raw" \
    ${CARGO_BUILD_TARGET:+--target "$CARGO_BUILD_TARGET"}
python3 scripts/bundle_ggml_libs.py "$raw"/lloyal*.whl "$CARGO_TARGET_DIR" "${MODULES[@]}"
mkdir -p "$DIST"
rm -f "$DIST"/lloyal*_"$ARCH".whl
auditwheel repair ${PLAT:+--plat "$PLAT"} "${EXCLUDE[@]}" -w "$DIST" "$raw"/lloyal*.whl
ls -l "$DIST"/lloyal*.whl
