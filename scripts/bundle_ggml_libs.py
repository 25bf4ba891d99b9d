"""Put llama.cpp's shared libraries and backend modules into a lloyal wheel.

For a wheel built with the `dynamic-backends` feature (see
scripts/build_wheel.sh): the extension ``lloyal/_lloyal*.so`` needs
libllama, libggml, libggml-base, libllama-common (found next to it through
its $ORIGIN rpath), and llama.cpp loads its compute backends
(``libggml-cpu-<variant>.so``, ``libggml-cuda.so``, ...) at run time from the
extension's directory (crates/lloyal-core/src/backend.rs). This script finds
them in llama-cpp-sys-2's build output and adds them under ``lloyal/``, each
library under the name the extension asks for (its soname), and rewrites the
wheel's RECORD.

    python scripts/bundle_ggml_libs.py dist-dl/lloyal-*.whl $CARGO_TARGET_DIR [MODULE.so ...]

Further arguments are backend modules built apart from the wheel from the
same source (``libggml-vulkan.so`` from scripts/build_vulkan_module.sh),
added the same way.

The Windows wheel (scripts/windows/build_wheel.sh) is bundled the same way:
``lloyal/_lloyal.pyd``, the DLLs it imports (``llama.dll``, ``ggml.dll``,
...) and the modules ``ggml-cpu-<variant>.dll``, found beside it by
Windows' loader and by backend.rs.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


def needed(data_path: str) -> list[str]:
    """The shared libraries a binary imports: ELF NEEDED entries, or a PE
    file's imported DLLs."""
    if data_path.endswith((".dll", ".pyd")):
        cmd = ["x86_64-w64-mingw32-objdump", "-p", data_path]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return [
            line.split("DLL Name:", 1)[1].strip()
            for line in out.stdout.splitlines()
            if "DLL Name:" in line
        ]
    out = subprocess.run(["readelf", "-d", data_path], capture_output=True, text=True, check=True)
    return [
        line.split("[", 1)[1].split("]", 1)[0]
        for line in out.stdout.splitlines()
        if "(NEEDED)" in line
    ]


# What the extension and llama.cpp's backend modules are called, by platform.
_LINUX = (".so", "libggml-*.so", "*.so*")
_WINDOWS = (".pyd", "ggml-*.dll", "*.dll")


def sys_out_dir(target_dir: str, modules: str) -> str:
    """The newest llama-cpp-sys-2 build output that has backend modules."""
    dirs = glob.glob(os.path.join(target_dir, "*", "build", "llama-cpp-sys-2-*", "out"))
    dirs = [d for d in dirs if glob.glob(os.path.join(d, "backends", modules))]
    if not dirs:
        raise SystemExit(f"no dynamic-backends llama-cpp-sys-2 build under {target_dir}")
    return max(dirs, key=lambda d: os.path.getmtime(os.path.join(d, "backends")))


def main() -> None:
    wheel, target_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    suffix, modules, libraries = _WINDOWS if wheel.endswith("win_amd64.whl") else _LINUX
    out = sys_out_dir(target_dir, modules)
    search = [os.path.join(out, d) for d in ("lib", "lib64", "bin", "build")]
    built = glob.glob(os.path.join(out, "build", "**", libraries), recursive=True)
    search += [os.path.dirname(p) for p in built]

    def find(soname: str) -> str | None:
        for d in search:
            p = os.path.join(d, soname)
            if os.path.exists(p):
                return os.path.realpath(p)
        return None

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        ext = next(n for n in names if n.startswith("lloyal/_lloyal") and n.endswith(suffix))
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        tmp = tempfile.mkdtemp()
        ext_path = zf.extract(ext, tmp)

    # The extension's llama.cpp libraries and theirs, by soname.
    libs: dict[str, str] = {}
    todo = needed(ext_path)
    while todo:
        soname = todo.pop()
        if soname in libs:
            continue
        path = find(soname)
        if path is None:
            continue  # a system library (libstdc++, libgomp, libc, kernel32, ...)
        libs[soname] = path
        todo += needed(path)
    for mod in sorted(glob.glob(os.path.join(out, "backends", modules))):
        libs[os.path.basename(mod)] = os.path.realpath(mod)
    for mod in extra:
        libs[os.path.basename(mod)] = os.path.realpath(mod)
    print(f"bundling from {out}:", *sorted(libs), sep="\n  ")

    fixed = wheel + ".tmp"
    rows: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(fixed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename == record:
                continue
            data = src.read(info.filename)
            dst.writestr(info, data)
            rows.append(row(info.filename, data))
        for soname, path in sorted(libs.items()):
            with open(path, "rb") as f:
                data = f.read()
            name = f"lloyal/{soname}"
            zi = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = 0o755 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(zi, data)
            rows.append(row(name, data))
        rows.append(f"{record},,")
        dst.writestr(record, "\n".join(rows) + "\n")
    os.replace(fixed, wheel)
    shutil.rmtree(tmp)
    print(f"{wheel}: {os.path.getsize(wheel) / 2**20:.1f} MiB")


def row(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


if __name__ == "__main__":
    main()
