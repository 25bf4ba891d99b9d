#!/usr/bin/env bash
# The tools the Windows cross build and its tests need, installed from
# Debian or unpacked into a cache (never over the system's Rust):
#
#   eval "$(scripts/windows/toolchain.sh)"   # prints the variables to export
#
# - MinGW-w64 (GCC 12, the posix thread model: llama.cpp needs std::thread),
#   Wine 8 and osslsigncode, from Debian's packages;
# - a Rust compiler whose standard library can be built for
#   x86_64-pc-windows-gnu: no prebuilt std matches the machine's rustup
#   toolchain, so Debian's rustc-web and its std source (rust-web-src), the
#   same version, are unpacked into $WIN_CACHE/rust and cargo builds std
#   with -Zbuild-std (RUSTC_BOOTSTRAP=1, the way Debian's own packages do);
# - a Wine prefix in $WIN_CACHE/wine with a stand-in for
#   bcryptprimitives.dll, which Wine 8 lacks and Rust's std imports
#   (ProcessPrng; real Windows has the DLL: see shims/processprng.c).
#
# Env: LLOYAL_WINDOWS_CACHE (default ~/.cache/lloyal/windows).
# Everything is done once; a second run only prints the variables.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WIN_CACHE="${LLOYAL_WINDOWS_CACHE:-$HOME/.cache/lloyal/windows}"
mkdir -p "$WIN_CACHE"

DEBIAN_PACKAGES=(gcc-mingw-w64-x86-64-posix g++-mingw-w64-x86-64-posix wine wine64
    osslsigncode cmake clang libclang-dev ccache unzip)
if ! dpkg -s "${DEBIAN_PACKAGES[@]}" >/dev/null 2>&1; then
    echo "toolchain.sh: installing ${DEBIAN_PACKAGES[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${DEBIAN_PACKAGES[@]}" >/dev/null
fi

# Debian's rustc-web, its std and std source: one version for all of them.
RUST="$WIN_CACHE/rust"
if [ ! -x "$RUST/usr/bin/rustc" ] || [ ! -d "$RUST/usr/src" ]; then
    version="$(apt-cache policy rustc-web | sed -n 's/^ *Candidate: //p')"
    case "$version" in
        "" | "(none)") echo "toolchain.sh: Debian offers no rustc-web" >&2; exit 1 ;;
    esac
    series="$(echo "$version" | sed -E 's/^([0-9]+\.[0-9]+).*/\1/')"
    # rustc-web links Debian's LLVM of its own: whichever libllvmN it needs.
    llvm="$(apt-cache depends "libstd-rust-web-$series" rustc-web |
        sed -n 's/^ *Depends: \(libllvm[0-9]*\)$/\1/p' | head -1)"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && apt-get download -qq "rustc-web=$version" "libstd-rust-web-$series=$version" \
        "libstd-rust-web-dev=$version" "rust-web-src=$version" ${llvm:+"$llvm"} >&2)
    rm -rf "$RUST.new"
    for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$RUST.new"; done
    rm -rf "$RUST"
    mv "$RUST.new" "$RUST"
fi
# -Zbuild-std reads the std source from the sysroot, where rust-web-src's
# link (usr/lib/rustlib/src/rust) already points.
if [ ! -d "$RUST/usr/lib/rustlib/src/rust/library" ]; then
    echo "toolchain.sh: no std source in $RUST (rust-web-src)" >&2
    exit 1
fi

# The Wine prefix, with the ProcessPrng stand-in in its system32.
export WINEPREFIX="$WIN_CACHE/wine"
export WINEDEBUG=-all
if [ ! -f "$WINEPREFIX/drive_c/windows/system32/bcryptprimitives.dll" ]; then
    wineboot --init >/dev/null 2>&1 || true
    wineserver -w || true
    x86_64-w64-mingw32-gcc-posix -O2 -shared -o "$WIN_CACHE/bcryptprimitives.dll" \
        "$HERE/shims/processprng.c" "$HERE/shims/processprng.def" -ladvapi32
    cp "$WIN_CACHE/bcryptprimitives.dll" "$WINEPREFIX/drive_c/windows/system32/"
fi

clang_resource="$(clang -print-resource-dir)"
cat <<EOF
export WIN_CACHE='$WIN_CACHE'
export WINEPREFIX='$WINEPREFIX'
export WINEDEBUG=-all
export RUSTC='$RUST/usr/bin/rustc'
export RUSTDOC='$RUST/usr/bin/rustdoc'
export LD_LIBRARY_PATH='$RUST/usr/lib/x86_64-linux-gnu'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export RUSTC_BOOTSTRAP=1
export CC_x86_64_pc_windows_gnu=x86_64-w64-mingw32-gcc-posix
export CXX_x86_64_pc_windows_gnu=x86_64-w64-mingw32-g++-posix
export AR_x86_64_pc_windows_gnu=x86_64-w64-mingw32-ar
export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER=x86_64-w64-mingw32-gcc-posix
export BINDGEN_EXTRA_CLANG_ARGS_x86_64_pc_windows_gnu='-resource-dir=$clang_resource'
EOF
