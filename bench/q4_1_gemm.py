"""Prompt speed of Q4_1 weights with and without the project's Q4_1 GEMM.

llama.cpp multiplies a batch of tokens by Q4_1 weights one dot product at a
time on x86 (llamafile's tinyBLAS covers Q4_0, Q5_0, Q8_0 and IQ4_NL, not
Q4_1); patches/llama.cpp/0002-* adds a tinyBLAS kernel for Q4_1 x Q8_1 with
the dot products' exact bits. SmolLM2, the default test model, is Q4_1.

Each run is a fresh process (this script as a child), the patched kernel
and the dot products (``GGML_CPU_DISABLE_Q4_1_GEMM=1``) taking turns in
alternating order, all measuring the same work after the same warm-up:

- ``prefill``: one 512-token prompt in one decode;
- ``burst``: 32 forks of a shared 1,450-token prefix each prefill 25 new
  tokens, one ``BranchStore.prefill`` (a turn of ``bench/server.py
  --workload agents``);
- ``decode``: 64 greedy tokens one at a time (one activation column: the
  dot products on both sides, so the ratio shows the host's noise).

Printed: milliseconds per side (min/median/max over the runs) and the
median of the runs' ratios, dot products' time over the GEMM's (> 1: the
GEMM is faster), with their min and max.

    python bench/q4_1_gemm.py [--model smollm2|PATH] [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import median
from lloyal.models import model_path

SWITCH = "GGML_CPU_DISABLE_Q4_1_GEMM"
WORK = ("prefill", "burst", "decode")


async def measure(path: str) -> dict[str, float]:
    """One run: each piece of work once after a warm-up decode."""
    async with await lloyal.create_context(path, n_ctx=4096, n_seq_max=34, n_batch=512) as ctx:
        text = " ".join(f"tool{i}(arg{i}: int) returns the value {i}." for i in range(400))
        tokens = await ctx.tokenize(text)
        assert len(tokens) >= 1450, len(tokens)
        store = lloyal.BranchStore(ctx)
        warm = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await warm.prefill(tokens[:64])
        await warm.prune()
        out: dict[str, float] = {}

        one = lloyal.Branch.create(ctx, lloyal.GREEDY)
        t0 = time.perf_counter()
        await one.prefill(tokens[:512])
        out["prefill"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(64):
            await one.commit((await one.produce()).token)
        out["decode"] = time.perf_counter() - t0
        await one.prune()

        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(tokens[:1450])
        kids = [await root.fork() for _ in range(32)]
        items = [(k, tokens[1450 - 25 * (i + 1) : 1450 - 25 * i]) for i, k in enumerate(kids)]
        t0 = time.perf_counter()
        await store.prefill(items)
        out["burst"] = time.perf_counter() - t0
        return out


def child(path: str, gemm: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != SWITCH}
    if not gemm:
        env[SWITCH] = "1"
    done = subprocess.run(
        [sys.executable, __file__, "--child", path],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def spread(xs: list[float]) -> str:
    return (
        f"{median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"
        if median(xs) > 10
        else f"{median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.child))))
        return
    path = str(model_path(args.model))
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.runs):
        for gemm in (True, False) if r % 2 == 0 else (False, True):
            runs[gemm].append(child(path, gemm))
    print(f"{Path(path).name}, {args.runs} runs a side, fresh process each")
    print(f"{'work':8} {'GEMM ms':>24} {'dot products ms':>24} {'dot / GEMM':>22}")
    for w in WORK:
        g = [1e3 * x[w] for x in runs[True]]
        d = [1e3 * x[w] for x in runs[False]]
        ratios = [b / a for a, b in zip(g, d, strict=True)]
        print(f"{w:8} {spread(g):>24} {spread(d):>24} {spread(ratios):>22}")


if __name__ == "__main__":
    main()
