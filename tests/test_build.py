"""What llama.cpp build is running: `backend_info()` (`lloyal info` and
`--version` are in test_cli.py). The same file runs against the source build
(`make test`) and the installed wheel (`make test-wheel`), and checks what
each promises."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import lloyal

# llama.cpp's x86 CPU modules (GGML_CPU_ALL_VARIANTS) that need no AVX2.
PRE_AVX2 = {"x64", "sse42", "sandybridge", "ivybridge", "piledriver"}


def host_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(m.group(1).split()) if m else set()


def test_backend_info_describes_this_build() -> None:
    info = lloyal.backend_info()
    assert info.version == lloyal.__version__
    assert info.llama_cpp_2_version == lloyal.LLAMA_CPP_2_VERSION
    assert "cpu" in [d.kind for d in info.devices]
    # Parsed from llama.cpp's own summary, CPU section only.
    assert info.cpu_features, info.system_info
    assert all(f"{f} = 1" in info.system_info for f in info.cpu_features)
    if info.dynamic_backends:
        # The wheel: the modules sit beside the extension (or in
        # $LLOYAL_BACKEND_DIR), and llama.cpp loaded one of them.
        package = Path(lloyal.__file__).resolve().parent
        chosen = os.environ.get("LLOYAL_BACKEND_DIR")
        assert info.module_dir is not None
        assert Path(info.module_dir).resolve() == Path(chosen or package).resolve()
        assert info.cpu_variant is not None
        module = (
            f"ggml-cpu-{info.cpu_variant}.dll"
            if sys.platform == "win32"
            else (f"libggml-cpu-{info.cpu_variant}.so")
        )
        assert (package / module).is_file()
        if "avx2" in host_flags() and not chosen:
            # The best module for the CPU, not merely one that runs.
            assert info.cpu_variant not in PRE_AVX2, info.cpu_variant
    else:
        assert info.cpu_variant is None
        assert info.module_dir is None


def test_gpu_backends_are_the_gpu_devices() -> None:
    info = lloyal.backend_info()
    gpus = {d.backend for d in info.devices if d.kind in ("gpu", "igpu")}
    assert set(info.gpu_backends) == gpus
    if gpus:
        assert lloyal.supports_gpu_offload()


def test_the_build_leaves_out_llama_cpps_amx_kernels() -> None:
    """GCC 12 miscompiles llama.cpp's AMX matmul (the tile configuration's
    row sizes are never stored), so on a CPU with AMX the first decode died
    with SIGSEGV. The build undefines the AMX macros (.cargo/config.toml);
    on such a CPU the AVX-512 kernels run instead. llama.cpp reports
    AMX_INT8 only when its AMX code is compiled in and the CPU has it, so
    this can fail only on an AMX host, where the rest of the suite would
    crash too."""
    info = lloyal.backend_info()
    assert not any(f.startswith("AMX") for f in info.cpu_features), info.system_info
