#!/usr/bin/env bash
# Build llama.cpp's Vulkan backend as a run-time module, libggml-vulkan.so,
# for a `dynamic-backends` lloyal wheel: the source is the llama.cpp that the
# pinned llama-cpp-sys-2 vendors, configured with the options that crate's
# build.rs gives the wheel's ggml (shared libraries, GGML_BACKEND_DL, the
# same -march), so the module links the wheel's libggml-base.so.0 and is
# loaded beside the CPU modules (crates/lloyal-core/src/backend.rs). Only
# that target is built; no Rust is involved.
#
#   scripts/build_vulkan_module.sh OUT_DIR    # -> OUT_DIR/libggml-vulkan.so
#
# Needs cmake, a C++17 compiler, glslc (shaderc), the Vulkan loader to link
# (libvulkan.so) and Vulkan headers new enough for llama.cpp (VK_EXT_layer_settings,
# Vulkan-Headers 1.3.272 or later) with SPIRV-Headers. On Debian 12
# (`apt-get install libvulkan-dev glslc spirv-headers`) the headers are
# older: the script then takes the headers of Debian 13's libvulkan-dev and
# spirv-headers packages (headers only, unpacked into
# ~/.cache/lloyal/vulkan-headers; nothing is installed). Elsewhere point
# VULKAN_HEADERS at a prefix holding include/vulkan and
# share/cmake/SPIRV-Headers (e.g. Vulkan-Headers and SPIRV-Headers installed
# there), and GLSLC at glslc if it is not on PATH.
#
# Env: CARGO_TARGET_DIR is not used. TARGET_CPU (the wheel's -march; default
# x86-64 on x86_64, armv8-a on aarch64), WORK (build dir; default
# ~/.cache/lloyal/vulkan-build, kept so a rebuild takes a minute, not ten),
# JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:?usage: scripts/build_vulkan_module.sh OUT_DIR}"
WORK="${WORK:-$HOME/.cache/lloyal/vulkan-build}"
JOBS="${JOBS:-$(nproc)}"
case "$(uname -m)" in
    x86_64) TARGET_CPU="${TARGET_CPU:-x86-64}" ;;
    aarch64) TARGET_CPU="${TARGET_CPU:-armv8-a}" ;;
    *) echo "build_vulkan_module.sh: unsupported architecture $(uname -m)" >&2; exit 2 ;;
esac

# The llama.cpp that lloyal builds: the pinned llama-cpp-sys-2 with the
# project's patches, in vendor/ (Cargo.toml's [patch.crates-io]).
scripts/patch_llama.sh
SRC="$(cargo metadata --format-version 1 --locked 2>/dev/null | python3 -c '
import json, os, sys
pkg = next(p for p in json.load(sys.stdin)["packages"] if p["name"] == "llama-cpp-sys-2")
print(os.path.join(os.path.dirname(pkg["manifest_path"]), "llama.cpp"))')"
test -f "$SRC/ggml/src/ggml-vulkan/CMakeLists.txt" || { echo "no llama.cpp source at $SRC" >&2; exit 1; }

headers_ok() { grep -qs VkLayerSettingEXT "$1/vulkan/vulkan_core.h"; }
cmake_headers=()
if [ -n "${VULKAN_HEADERS:-}" ]; then
    cmake_headers=(-DVulkan_INCLUDE_DIR="$VULKAN_HEADERS/include"
        -DSPIRV-Headers_DIR="$VULKAN_HEADERS/share/cmake/SPIRV-Headers")
elif ! headers_ok /usr/include; then
    prefix="$HOME/.cache/lloyal/vulkan-headers"
    if ! headers_ok "$prefix/usr/include"; then
        command -v apt-get >/dev/null || {
            echo "the system's Vulkan headers lack VK_EXT_layer_settings: set VULKAN_HEADERS" >&2
            exit 1
        }
        echo "the system's Vulkan headers are too old for llama.cpp: using Debian 13's"
        apt_dir="$(mktemp -d)"
        mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
        echo "deb http://deb.debian.org/debian trixie main" >"$apt_dir/sources.list"
        opts=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::State::Lists="$apt_dir/lists" -o Dir::Cache="$apt_dir/cache"
            -o APT::Sandbox::User=root)
        apt-get "${opts[@]}" update -qq
        (cd "$apt_dir" && apt-get "${opts[@]}" download -qq libvulkan-dev spirv-headers)
        rm -rf "$prefix" && mkdir -p "$prefix"
        for deb in "$apt_dir"/*.deb; do dpkg-deb -x "$deb" "$prefix"; done
        rm -rf "$apt_dir"
    fi
    cmake_headers=(-DVulkan_INCLUDE_DIR="$prefix/usr/include"
        -DSPIRV-Headers_DIR="$prefix/usr/share/cmake/SPIRV-Headers")
fi

start=$(date +%s)
cmake -S "$SRC" -B "$WORK" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="-march=$TARGET_CPU" -DCMAKE_CXX_FLAGS="-march=$TARGET_CPU" \
    -DBUILD_SHARED_LIBS=ON -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF \
    -DGGML_VULKAN=ON "${cmake_headers[@]}" ${GLSLC:+-DVulkan_GLSLC_EXECUTABLE="$GLSLC"} \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_DISABLE_FIND_PACKAGE_OpenSSL=ON >"$WORK.configure.log" 2>&1 ||
    { tail -30 "$WORK.configure.log" >&2; exit 1; }
cmake --build "$WORK" --target ggml-vulkan -j "$JOBS" >"$WORK.build.log" 2>&1 ||
    { grep -m20 -B2 -A5 "error" "$WORK.build.log" >&2; exit 1; }
mkdir -p "$OUT_DIR"
cp "$WORK/bin/libggml-vulkan.so" "$OUT_DIR/"
echo "libggml-vulkan.so built in $(($(date +%s) - start)) s -> $OUT_DIR"
