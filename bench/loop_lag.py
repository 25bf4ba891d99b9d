"""How long `Branch.produce()` keeps the event loop from running other
tasks, side by side in one run: sampling on the loop thread (the native
call made directly) against `produce()` (which moves a slow sampler to a
worker thread). A ticker task records the longest gap between its turns
while 30 produce() calls run; produce's own median time is printed too.

    python bench/loop_lag.py [--models gemma3,smollm2]

Measured on the 2-core AVX-512 VM (2026-11-24), longest stall / median
call in ms, on the loop vs through produce() (the engine's sampler
thread): Gemma 3 top_k=0 9.89 / 9.30 vs 0.34 / 9.55; SmolLM2 top_k=0
1.72 / 1.53 vs 0.25 / 2.65. Greedy and top_k=40 stay on the loop (Gemma
3 top_k=40: 0.59 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from lloyal.models import model_path

CONFIGS = {
    "greedy": lloyal.GREEDY,
    "top_k=40": lloyal.SamplingParams(seed=1),
    "top_k=0": lloyal.SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=1),
}


async def lag_while(run: Callable[[], Awaitable[object]], n: int = 30) -> tuple[float, float]:
    """(longest gap between the ticker's turns, median call time), in ms,
    after one call to warm up (the first call into a thread pool starts it)."""
    await run()
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await run()
        times.append(time.perf_counter() - t)
        await asyncio.sleep(0)
    done = True
    await task
    return max(gaps) * 1e3, statistics.median(times) * 1e3


async def bench(name: str) -> None:
    async with await lloyal.create_context(model_path(name), n_seq_max=2) as ctx:
        print(f"\n{name} (vocabulary {ctx.vocab_size}): longest loop stall / median call, ms")
        print(f"  {'sampler':10} {'on the loop':>22} {'produce()':>22}")
        for label, params in CONFIGS.items():
            b = lloyal.Branch.create(ctx, params)
            await b.prefill(await ctx.tokenize("Once upon a time"))

            async def inline(b: lloyal.Branch = b) -> object:
                return b._produce_now(inline=True)

            on_loop = await lag_while(inline)
            via = await lag_while(b.produce)
            print(
                f"  {label:10} {on_loop[0]:10.2f} / {on_loop[1]:7.3f}  "
                f"{via[0]:10.2f} / {via[1]:7.3f}"
            )
            await b.prune()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma3,smollm2")
    args = ap.parse_args()
    for name in args.models.split(","):
        asyncio.run(bench(name))


if __name__ == "__main__":
    main()
