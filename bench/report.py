"""One benchmark report: every bench/ script, one comparison table, one chart.

Runs bench/branching.py (lloyal's Python API, the raw Rust batched loop over
llama-cpp-2 and, unless --no-llama-cpp-python, best-of-N the way
llama-cpp-python users must do it, in a venv the script builds) and prints
one table of aggregate tok/s per number of branches with the ratios of the
same run; writes a PNG chart of tok/s against N (matplotlib, installed by
``make bench``). Then runs decode.py, grammar.py, adapters.py and streaming.py and prints
their side-by-side results.

    python bench/report.py [--quick] [--no-llama-cpp-python] [--chart bench.png]
    lloyal bench ...            # the same, from a source checkout
    make bench                  # the same, after installing what it needs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run(script: str, *args: str) -> None:
    print(f"\n=== {script} {' '.join(args)}".rstrip(), flush=True)
    subprocess.run([sys.executable, str(BENCH / script), *args], check=True)


def table(results: dict[str, dict[str, list[dict[str, float | None]]]]) -> str:
    lines = [
        f"{'model':9} {'N':>3} {'lloyal':>9} {'raw Rust':>9} {'llama-cpp-py':>13} "
        f"{'lloyal/raw':>11} {'lloyal/lcp':>11}"
    ]
    for model, r in results.items():
        for row in r["lockstep"]:
            py, raw, lcp = row["python"] or 0.0, row["raw"] or 1.0, row["lcp"]
            lcp_text = f"{lcp:13.1f}" if lcp else f"{'-':>13}"
            ratio = f"{py / lcp:10.2f}x" if lcp else f"{'-':>11}"
            lines.append(
                f"{model:9} {int(row['n'] or 0):3d} {py:9.1f} {raw:9.1f} {lcp_text} "
                f"{row.get('ratio') or py / raw:10.3f}x {ratio}"
            )
    return "\n".join(lines)


def chart(results: dict[str, dict[str, list[dict[str, float | None]]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no chart: pip install matplotlib)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (model, r) in zip(axes[0], results.items(), strict=True):
        rows = r["lockstep"]
        ns = [row["n"] for row in rows]
        ax.plot(ns, [row["python"] for row in rows], "o-", label="lloyal (Python API)")
        ax.plot(ns, [row["raw"] for row in rows], "s--", label="raw Rust loop (llama-cpp-2)")
        if all(row["lcp"] for row in rows):
            ax.plot(ns, [row["lcp"] for row in rows], "^:", label="llama-cpp-python best-of-N")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("branches in lockstep (N)")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps and widths (a smoke run)")
    ap.add_argument("--no-llama-cpp-python", action="store_true")
    ap.add_argument("--chart", default="bench-branching.png", help="PNG to write")
    ap.add_argument("--models", default="smollm2,gemma3")
    args = ap.parse_args(argv)
    models = [m for name in args.models.split(",") for m in ("--model", name)]
    size = ["--steps", "8", "--runs", "1", "--widths", "1,2,4"] if args.quick else []
    lcp = [] if args.no_llama_cpp_python else ["--llama-cpp-python"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "branching.json"
        run("branching.py", *models, *size, *lcp, "--json", str(out))
        results = json.loads(out.read_text())
    print("\n=== lloyal vs the raw Rust loop vs llama-cpp-python (aggregate tok/s, one run)")
    print(table(results))
    if chart(results, Path(args.chart)):
        print(f"chart: {args.chart}")
    quick_decode = ["--runs", "1", "--gen", "16"] if args.quick else []
    for name in args.models.split(","):
        run("decode.py", "--model", name, *quick_decode)
        run(
            "grammar.py",
            "--model",
            name,
            *(["--tokens", "16", "--rounds", "1"] if args.quick else []),
        )
        run(
            "adapters.py",
            "--model",
            name,
            *(["--tokens", "8", "--rounds", "1"] if args.quick else []),
        )
    if not args.quick:
        run("streaming.py", "--models", args.models)
    return 0


if __name__ == "__main__":
    sys.exit(main())
