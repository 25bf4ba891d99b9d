"""The benchmark report's table and chart (the measurements themselves run
in `lloyal bench` / `make bench`, never in the test suite)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from report import chart, table

RESULTS = {
    "smollm2": {
        "lockstep": [
            {"n": 1, "raw": 100.0, "python": 95.0, "lcp": 60.0},
            {"n": 8, "raw": 150.0, "python": 148.5, "lcp": 62.0},
        ]
    },
    "gemma3": {"lockstep": [{"n": 1, "raw": 50.0, "python": 49.0, "lcp": None}]},
}


def test_table_prints_ratios_from_the_same_run() -> None:
    text = table(RESULTS)  # type: ignore[arg-type]
    lines = text.splitlines()
    assert "lloyal/raw" in lines[0]
    assert "0.950x" in lines[1]
    assert "1.58x" in lines[1]  # 95 / 60
    assert "0.990x" in lines[2]
    assert lines[3].split()[4] == "-"  # no llama-cpp-python figure


def test_chart_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    assert chart(RESULTS, out)  # type: ignore[arg-type]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
