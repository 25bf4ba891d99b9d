"""Exit soak: scripts that leave contexts, branches, sessions or a server
open (tests/exit_child.py) must end, with status 0, within 5 s of their
work every time. Runs each scenario ``--runs`` times, two at a time.

    python bench/exit.py [--model smollm2] [--runs 100] [--scenario context ...]

Prints, per scenario, how many runs exited cleanly and the slowest exit
(seconds from the child's "ok" to its end); exit status 1 if any run hung
(killed after 5 s) or failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lloyal.models import KNOWN_MODELS, model_path

CHILD = Path(__file__).resolve().parent.parent / "tests" / "exit_child.py"
SCENARIOS = ["context", "native", "branches", "session", "server", "trio"]
EXIT_LIMIT_S = 5.0


def one_run(scenario: str, model: Path) -> tuple[bool, float, str]:
    """Whether the run ended cleanly within EXIT_LIMIT_S of printing "ok",
    how long its exit took, and its stderr if it did not."""
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), scenario, str(model)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    said_ok = time.perf_counter()
    try:
        rc = proc.wait(timeout=EXIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False, EXIT_LIMIT_S, f"still running {EXIT_LIMIT_S} s after {line.strip()!r}"
    took = time.perf_counter() - said_ok
    err = proc.stderr.read() if proc.stderr else ""
    return rc == 0 and line.strip() == "ok", took, f"status {rc}, printed {line.strip()!r}: {err}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", choices=sorted(KNOWN_MODELS))
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--scenario", nargs="*", default=SCENARIOS, choices=SCENARIOS)
    args = parser.parse_args()
    model = model_path(args.model)
    failed = False
    print(f"{'scenario':<10} {'clean':>9} {'slowest exit s':>15}")
    for scenario in args.scenario:
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(one_run, [scenario] * args.runs, [model] * args.runs))
        clean = sum(ok for ok, _, _ in runs)
        slowest = max(took for _, took, _ in runs)
        print(f"{scenario:<10} {clean:>4}/{args.runs:<4} {slowest:>15.2f}", flush=True)
        for ok, _, err in runs:
            if not ok:
                failed = True
                print(f"  failed: {err.strip()[-500:]}")
                break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
