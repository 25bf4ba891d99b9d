"""What `create_context(deterministic=True)` costs against the default,
side by side in one run.

The mode (docs/determinism.md; tests/test_determinism.py) loads the
weights without repacking, turns llama.cpp's tiled K-quant matmul off for
the process (GGML_CPU_TILED_MM=0) and uses a q8_0 KV cache, so a branch
gets the same bits whatever it is batched with. This prints, for N = 1, 8
and 16 branches decoding in lockstep (one `BranchStore.commit` per step),
tokens per second in each mode and their ratio (medians of `--repeats`,
the modes alternating), plus the prefill rate of a 512-token text. The
tiled-matmul switch is per process, so every measurement runs in a fresh
interpreter (`--child`).

    python bench/determinism.py [--models smollm2,gemma3] [--steps 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import median
from lloyal.models import model_path

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, and"
MODES = ("default", "deterministic")


async def lockstep(name: str, mode: str, n: int, steps: int) -> tuple[float, float]:
    """(decode tokens/s over `steps` lockstep steps of `n` branches,
    prefill tokens/s of a 512-token text)."""
    async with await lloyal.create_context(
        model_path(name), n_ctx=2048, n_seq_max=n + 1, deterministic=mode == "deterministic"
    ) as ctx:
        text = await ctx.tokenize("The river ran past the mill and under the bridge. " * 60)
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        started = time.perf_counter()
        await b.prefill(text[:512])
        prefill = 512 / (time.perf_counter() - started)
        await b.prune()
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kids = [await root.fork() for _ in range(n)]
        store = lloyal.BranchStore(ctx)
        started = time.perf_counter()
        for _ in range(steps):
            await store.commit([(k, (await k.produce()).token) for k in kids])
        decode = n * steps / (time.perf_counter() - started)
        await root.prune_subtree()
        return decode, prefill


def measure(name: str, mode: str, n: int, steps: int) -> tuple[float, float]:
    """`lockstep` in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", name, mode, str(n), str(steps)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    decode, prefill = json.loads(out.strip().splitlines()[-1])
    return float(decode), float(prefill)


def bench_model(name: str, steps: int, repeats: int) -> None:
    print(f"\n{name}: tokens/s, default vs deterministic=True (ratio deterministic / default)")
    prefill: dict[str, list[float]] = {m: [] for m in MODES}
    for n in (1, 8, 16):
        decode: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeats):
            for mode in MODES:
                d, p = measure(name, mode, n, steps)
                decode[mode].append(d)
                prefill[mode].append(p)
        plain, det = median(decode["default"]), median(decode["deterministic"])
        print(f"  N={n:2d} decode  {plain:7.1f}  {det:7.1f}  ({det / plain:.3f})", flush=True)
    plain, det = median(prefill["default"]), median(prefill["deterministic"])
    print(f"  prefill 512  {plain:7.1f}  {det:7.1f}  ({det / plain:.3f})", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, mode, n, steps = sys.argv[2:6]
        print(json.dumps(asyncio.run(lockstep(name, mode, int(n), int(steps)))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in args.models.split(","):
        bench_model(name, args.steps, args.repeats)


if __name__ == "__main__":
    main()
