"""What llama.cpp build is running: `backend_info()`, `lloyal info`, `lloyal
--version`. The same file runs against the source build (`make test`) and
the installed wheel (`make test-wheel`), and checks what each promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lloyal

# llama.cpp's x86 CPU modules (GGML_CPU_ALL_VARIANTS) that need no AVX2.
PRE_AVX2 = {"x64", "sse42", "sandybridge", "ivybridge", "piledriver"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lloyal", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


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
        assert (package / f"libggml-cpu-{info.cpu_variant}.so").is_file()
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


def test_version_flag() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"lloyal {lloyal.__version__} (llama-cpp-2 {lloyal.LLAMA_CPP_2_VERSION})"
    )


def test_info_prints_the_build_and_the_model(smollm2: Path) -> None:
    result = run_cli("info", "--model", str(smollm2), "--n-ctx", "256")
    assert result.returncode == 0, result.stderr
    info = lloyal.backend_info()
    assert re.search(rf"^cpu variant\s+{re.escape(info.cpu_variant or '-')}$", result.stdout, re.M)
    assert re.search(r"^architecture\s+llama$", result.stdout, re.M)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
