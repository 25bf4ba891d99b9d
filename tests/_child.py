"""Checks that must run in a fresh interpreter: llama.cpp reads some
switches once per process (``GGML_CPU_TILED_MM`` for the deterministic mode,
``GGML_CPU_DISABLE_FA_SPARSE`` for the flash attention patch), and the test
process has decoded long before. A child script prints one JSON value as
its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._hang import HANG_GUARD_S

# The switches a child must not inherit from whoever ran the suite.
ONCE_PER_PROCESS = ("GGML_CPU_TILED_MM", "GGML_CPU_DISABLE_FA_SPARSE")


def run_child(script: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """Run ``script`` with ``args`` in a fresh interpreter, in this process's
    environment less the once-per-process switches, plus ``env``; its JSON
    answer."""
    full = {k: v for k, v in os.environ.items() if k not in ONCE_PER_PROCESS}
    full.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=full,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
