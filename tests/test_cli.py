"""The command line, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def lloyal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lloyal", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_generate_streams_text_and_prints_a_summary() -> None:
    result = lloyal(
        "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr
    assert "perplexity" in result.stderr


def test_generate_chat_with_gemma_needs_and_takes_a_template(gemma3: Path) -> None:
    no_template = lloyal("generate", "Hi", "--chat", "--model", str(gemma3), "--max-tokens", "2")
    assert no_template.returncode == 1
    assert "no chat template" in no_template.stderr
    ok = lloyal(
        "generate",
        "Hi",
        "--chat",
        "--template",
        "gemma",
        "--model",
        str(gemma3),
        "--max-tokens",
        "4",
        "--seed",
        "1",
    )
    assert ok.returncode == 0, ok.stderr


def test_info_prints_metadata(gemma3: Path) -> None:
    result = lloyal("info", "--model", str(gemma3))
    assert result.returncode == 0, result.stderr
    assert "gemma3" in result.stdout
    assert "no (base model)" in result.stdout


def test_bad_input_exits_non_zero(tmp_path: Path) -> None:
    missing = lloyal("generate", "x", "--model", str(tmp_path / "none.gguf"))
    assert missing.returncode == 1
    assert "not found" in missing.stderr
    bogus = tmp_path / "bogus.gguf"
    bogus.write_text("nope")
    assert lloyal("info", "--model", str(bogus)).returncode == 1
    assert lloyal("generate", "x", "--max-tokens", "-1").returncode == 2
    assert lloyal("generate", "x", "--top-p", "7").returncode == 1
    assert lloyal("bogus-command").returncode == 2
