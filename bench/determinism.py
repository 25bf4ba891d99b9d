"""What the batch-invariant setting costs: a q8_0 KV cache against the
default f16, side by side in one run.

With `type_k=type_v="q8_0"` flash attention runs one kernel whatever the
batch, so a branch of a model whose weights take llama.cpp's dot-product
path (SmolLM2's Q4_1) gets the same bits alone, in a batch or split
(docs/determinism.md; tests/test_determinism.py). This prints, for N = 1, 8
and 16 branches decoding in lockstep (one `BranchStore.commit` per step),
tokens per second with each KV type and their ratio (medians of
`--repeats`, the two settings alternating), plus the prefill rate.

    python bench/determinism.py [--models smollm2,gemma3] [--steps 32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import median
from lloyal.context import KVType
from lloyal.models import model_path

PROMPT = "The lighthouse keeper climbed the spiral stairs every evening at dusk, and"
KV_TYPES: tuple[KVType, ...] = ("f16", "q8_0")


async def lockstep(name: str, kv: KVType, n: int, steps: int) -> tuple[float, float]:
    """(decode tokens/s over `steps` lockstep steps of `n` branches,
    prefill tokens/s of a 512-token text)."""
    async with await lloyal.create_context(
        model_path(name), n_ctx=2048, n_seq_max=n + 1, type_k=kv, type_v=kv
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


async def bench_model(name: str, steps: int, repeats: int) -> None:
    print(f"\n{name}: tokens/s, f16 KV vs q8_0 KV (ratio q8_0 / f16)")
    prefill: dict[str, list[float]] = {kv: [] for kv in KV_TYPES}
    for n in (1, 8, 16):
        decode: dict[str, list[float]] = {kv: [] for kv in KV_TYPES}
        for _ in range(repeats):
            for kv in KV_TYPES:
                d, p = await lockstep(name, kv, n, steps)
                decode[kv].append(d)
                prefill[kv].append(p)
        f16, q8 = median(decode["f16"]), median(decode["q8_0"])
        print(f"  N={n:2d} decode  {f16:7.1f}  {q8:7.1f}  ({q8 / f16:.3f})")
    f16, q8 = median(prefill["f16"]), median(prefill["q8_0"])
    print(f"  prefill 512  {f16:7.1f}  {q8:7.1f}  ({q8 / f16:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in args.models.split(","):
        asyncio.run(bench_model(name, args.steps, args.repeats))


if __name__ == "__main__":
    main()
