"""Soak: many fork / commit / prune cycles must leak neither KV leases nor
memory. Prints leases and resident memory (RSS) as the cycles go by.

    python bench/soak.py [--model smollm2] [--cycles 10000]

Passes (exit 0) when every lease is back and RSS grew by less than
--max-growth-mib between the first checkpoint (after warm-up) and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import lloyal
from lloyal.models import KNOWN_MODELS, model_path


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(path: Path, cycles: int, width: int) -> tuple[int, int, float, float]:
    async with await lloyal.create_context(path, n_ctx=1024, n_seq_max=width + 1) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.SamplingParams(seed=1))
        await root.prefill(await ctx.tokenize("A short shared prefix for the soak test"))
        baseline = None
        started = time.perf_counter()
        for cycle in range(1, cycles + 1):
            kids = [await root.fork() for _ in range(width)]
            await store.commit([(k, (await k.produce()).token) for k in kids])
            for k in kids:
                await k.prune()
            if cycle == min(500, cycles) or cycle % 2000 == 0 or cycle == cycles:
                rss = rss_mib()
                baseline = baseline if baseline is not None else rss
                print(
                    f"cycle {cycle:>6}  leases free {store.available}/{ctx.n_seq_max}  "
                    f"RSS {rss:7.1f} MiB  {cycle / (time.perf_counter() - started):6.1f} cycles/s",
                    flush=True,
                )
        return store.available, ctx.n_seq_max, baseline or 0.0, rss_mib()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--width", type=int, default=2, help="forks per cycle")
    parser.add_argument("--max-growth-mib", type=float, default=20.0)
    args = parser.parse_args()
    path = model_path(args.model) if args.model in KNOWN_MODELS else Path(args.model)
    free, total, first, last = asyncio.run(soak(path, args.cycles, args.width))
    leaked = total - 1 - free
    grew = last - first
    print(f"leases leaked: {leaked}; RSS growth after warm-up: {grew:+.1f} MiB")
    return 0 if leaked == 0 and grew < args.max_growth_mib else 1


if __name__ == "__main__":
    sys.exit(main())
