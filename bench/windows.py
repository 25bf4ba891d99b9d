"""Decode speed on Windows' CPython under Wine beside Linux, on this machine.

For information (docs/windows.md): the same loop -- a 100-token prompt,
then 64 greedy tokens one decode each, timed from the first of them -- in a
fresh process of each side, taking turns: the project's Linux build
(.venv) and the Windows wheel that ``make test-windows`` installed for
Windows' CPython 3.12 under Wine. Each side runs with 1 and with 2 decode
threads (``n_threads``).

    make test-windows            # once: the Windows interpreter and wheel
    python bench/windows.py [--rounds 3]

Printed: tokens per second for each side and thread count (min/median/max
over the rounds) and the ratio Wine / Linux (median, min-max).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from _common import ROOT, spread

LOOP = """
import asyncio, sys, time
import lloyal
from lloyal.models import model_path

async def main(threads):
    model = model_path("smollm2")
    async with await lloyal.create_context(model, n_ctx=512, n_threads=threads) as ctx:
        prompt = (await ctx.tokenize("The river runs through the old town, and")) * 10
        await ctx.decode(prompt, 0)
        token, n = ctx.greedy_sample(), len(prompt)
        t0 = time.perf_counter()
        for i in range(64):
            await ctx.decode([token], n + i)
            token = ctx.greedy_sample()
        print(64 / (time.perf_counter() - t0))

asyncio.run(main(int(sys.argv[1])))
"""


def _wine() -> tuple[list[str], dict[str, str]]:
    cache = Path(os.environ.get("LLOYAL_WINDOWS_CACHE", Path.home() / ".cache/lloyal/windows"))
    python = cache / "python-cp312" / "python.exe"
    site = cache / "site-cp312"
    if not python.exists() or not site.exists():
        sys.exit("no Windows interpreter or wheel installed: run `make test-windows` first")
    env = {**os.environ, "WINEPREFIX": str(cache / "wine"), "WINEDEBUG": "-all"}
    env["PYTHONPATH"] = f"Z:{site}"
    return ["wine", str(python)], env


def _run(cmd: list[str], env: dict[str, str], threads: int, script: Path) -> float:
    out = subprocess.run(
        [*cmd, str(script), str(threads)],
        env=env,
        stdin=subprocess.DEVNULL,  # Wine's CPython needs pipes, not files
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    script = ROOT / "bench" / ".windows_loop.py"
    script.write_text(LOOP)
    wine, wine_env = _wine()
    linux = [str(ROOT / ".venv" / "bin" / "python")]
    try:
        for threads in (1, 2):
            tps: dict[str, list[float]] = {"linux": [], "wine": []}
            for i in range(args.rounds):
                order = [("linux", linux, dict(os.environ)), ("wine", wine, wine_env)]
                for name, cmd, env in order if i % 2 == 0 else reversed(order):
                    tps[name].append(_run(cmd, env, threads, script))
            for name, xs in tps.items():
                s = sorted(xs)
                low, mid, high = s[0], s[len(s) // 2], s[-1]
                print(f"{threads} thread(s), {name}: {low:.1f} / {mid:.1f} / {high:.1f} tok/s")
            ratios = [w / lx for w, lx in zip(tps["wine"], tps["linux"], strict=True)]
            print(f"{threads} thread(s), Wine / Linux: {spread(ratios)}")
    finally:
        script.unlink()


if __name__ == "__main__":
    main()
