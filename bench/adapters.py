"""What LoRA adapter sets cost, measured side by side in one run.

N branches generate greedy tokens in lockstep (one ``BranchStore.commit``
per step) under four setups: the base model; every branch under one random
LoRA (``lloyal.fixtures``); half the branches under the LoRA and half
without (two decodes per step, one per set); and every branch switching
set each step (a set change per decode: llama.cpp rebuilds its graph).
Rounds alternate the setups so machine noise hits all; medians of tok/s and
their ratios to the base are printed.

    python bench/adapters.py [--model smollm2|gemma3|PATH] [--n 8] [--tokens 32] [--rounds 3]

Targets: one LoRA >= 0.8x the base model's tok/s at rank 8; two sets of N/2
>= 0.6x (two decodes of N/2 tokens instead of one of N).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import lloyal
from lloyal import fixtures
from lloyal.models import KNOWN_MODELS, model_path

SETUPS = ("base", "one LoRA", "two sets", "switching")


async def run(ctx: lloyal.Context, lora: lloyal.Lora, setup: str, n: int, tokens: int) -> float:
    """tok/s of ``n`` branches committing ``tokens`` tokens each in lockstep."""
    prompt = await ctx.tokenize("Write a short story about a lighthouse keeper.")
    store = lloyal.BranchStore(ctx)
    branches = [lloyal.Branch.create(ctx, lloyal.GREEDY) for _ in range(n)]
    for i, b in enumerate(branches):
        if setup == "one LoRA" or (setup == "two sets" and i % 2):
            b.set_adapters(lora)
    await store.prefill([(b, prompt) for b in branches])
    started = time.perf_counter()
    for step in range(tokens):
        if setup == "switching":
            for b in branches:
                b.set_adapters(lora if step % 2 else None)
        picks = await store.produce(branches)
        await store.commit([(b, p.token) for b, p in zip(branches, picks, strict=True)])
    elapsed = time.perf_counter() - started
    for b in branches:
        await b.prune()
    return n * tokens / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help=f"{' / '.join(KNOWN_MODELS)} or a path")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    known = args.model in KNOWN_MODELS
    path = model_path(args.model) if known else Path(args.model)
    lora_file = fixtures.lora("random", args.model if known else "smollm2")
    n_ctx = args.n * (args.tokens + 64) + 256
    async with await lloyal.create_context(path, n_ctx=n_ctx, n_seq_max=args.n) as ctx:
        lora = await ctx.load_lora(lora_file)
        await run(ctx, lora, "base", args.n, 4)  # warm-up
        speeds: dict[str, list[float]] = {s: [] for s in SETUPS}
        for _ in range(args.rounds):
            for setup in SETUPS:
                speeds[setup].append(await run(ctx, lora, setup, args.n, args.tokens))
    base = statistics.median(speeds["base"])
    print(f"{path.name}: N={args.n}, {args.tokens} tokens each, median of {args.rounds} rounds")
    print(f"{'setup':<10} {'tok/s':>8} {'vs base':>8}")
    for setup in SETUPS:
        tps = statistics.median(speeds[setup])
        print(f"{setup:<10} {tps:8.1f} {tps / base:8.2f}")


if __name__ == "__main__":
    asyncio.run(main())
