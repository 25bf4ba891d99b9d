"""Every example runs, with small limits, on the test models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_flat_loop_on_both_models(gemma3: Path) -> None:
    script = str(ROOT / "examples" / "flat_loop" / "flat_loop.py")
    smol = run_example(script, "Name a river.", "--max-tokens", "12")
    assert smol.returncode == 0, smol.stderr
    assert "perplexity" in smol.stdout
    gemma = run_example(
        script, "Name a river.", "--model", str(gemma3), "--template", "gemma", "--max-tokens", "8"
    )
    assert gemma.returncode == 0, gemma.stderr
    assert "perplexity" in gemma.stdout
