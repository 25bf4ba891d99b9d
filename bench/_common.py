"""Helpers shared by the benchmarks: building and running the Rust baselines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))


def build_example(name: str) -> Path:
    """Build a lloyal-core example with the project's one cargo profile."""
    subprocess.run(
        ["cargo", "build", "--quiet", "-p", "lloyal-core", "--example", name],
        cwd=ROOT,
        check=True,
    )
    return target_dir() / "debug" / "examples" / name


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# The switch of patches/llama.cpp/0001-*: set to 1, llama.cpp's CPU flash
# attention scans every KV cell as upstream's does (read once per process).
DENSE_ATTENTION = "GGML_CPU_DISABLE_FA_SPARSE"


def raw_lockstep(
    model: Path,
    prompts: list[list[int]],
    steps: int,
    threads: int,
    lanes: int,
    kv: str,
    upstream_attention: bool = False,
) -> dict[str, Any]:
    """Plain llama-cpp-2 over ``prompts``, ``lanes`` at a time, ``steps``
    lockstep steps each, ``kv`` layout (``examples/raw_lockstep.rs``): its
    JSON answer (``seconds``, ``prefill_seconds``, ``step_seconds``,
    ``decodes``). ``upstream_attention`` turns off the project's flash
    attention patch (patches/llama.cpp/0001-*: the CPU kernel reads only the
    cells a row sees) for this run, as unpatched llama.cpp computes."""
    binary = build_example("raw_lockstep")
    env = dict(os.environ)
    if upstream_attention:
        env[DENSE_ATTENTION] = "1"
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(prompts, f)
        f.flush()
        cmd = [binary, model, f.name, steps, threads, lanes, kv]
        return run_json([str(x) for x in cmd], env)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


VENV = Path.home() / ".cache" / "lloyal" / "bench-venv"

# The llama.cpp peers are compiled as lloyal is (.cargo/config.toml): with
# llama.cpp's AMX kernels left out. GCC 12 miscompiles them (SIGSEGV at the
# first decode on a CPU with AMX), and with them the peers would run other
# kernels than lloyal on such a CPU.
NO_AMX = "-U__AMX_TILE__ -U__AMX_INT8__ -U__AMX_BF16__"
CMAKE_NO_AMX = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def llama_cpp_python(extra: str = "") -> Path:
    """The python of a venv with llama-cpp-python (``extra``: e.g.
    ``"[server]"``), built for this CPU the first time (several minutes)."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    module = "llama_cpp.server" if extra == "[server]" else "llama_cpp"
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    if probe.returncode != 0:
        print("building llama-cpp-python in", VENV, "(several minutes)", file=sys.stderr)
        flags = " ".join(f"'{f}'" for f in CMAKE_NO_AMX)
        env = {**os.environ, "CMAKE_ARGS": f"-DGGML_NATIVE=ON {flags}"}
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python{extra}"],
            check=True,
            env=env,
        )
    return python


def spread(ratios: list[float]) -> str:
    """A ratio as the benches print it: the median of the rounds', with their
    min and max, so the host's noise shows."""
    return f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
