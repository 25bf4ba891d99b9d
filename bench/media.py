"""What an image in N branches costs, measured side by side in one run.

N branches each need the same image prompt (a chat turn with one image,
``lloyal.fixtures.mmproj``'s random projector): encoded and decoded into
each branch on its own, or once into a root that N forks share. A third
setup is the same prompt without the image, as text only, for scale.
Rounds alternate the setups so machine noise hits all; medians of the
seconds to have N branches ready and their ratios are printed.

    python bench/media.py [--model smollm2|gemma3] [--n 8] [--rounds 3]

Target: N forks of one image prompt >= 0.8 * N times faster than N
encodes (a fork copies cell metadata; an encode runs the projector and
decodes the prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import lloyal
import numpy as np
from lloyal import fixtures
from lloyal.models import model_path

SETUPS = ("N encodes", "1 encode + forks", "text only")


async def run(ctx: lloyal.Context, setup: str, n: int, seed: int, template: str | None) -> float:
    """Seconds until ``n`` branches hold the prompt (a fresh image each round)."""
    image = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    parts = [{"type": "text", "text": "Describe the picture."}, {"type": "image", "image": image}]
    chat = ctx.format_chat([{"role": "user", "content": parts}], template=template)
    if setup == "text only":
        tokens = await ctx.tokenize(chat.prompt.replace(lloyal.MEDIA_MARKER, ""))
    else:
        tokens = await ctx.tokenize(chat.prompt, media=chat.media)
    started = time.perf_counter()
    if setup == "1 encode + forks":
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(tokens)
        branches = [root, *[await root.fork() for _ in range(n - 1)]]
    else:
        branches = [lloyal.Branch.create(ctx, lloyal.GREEDY) for _ in range(n)]
        for b in branches:
            await b.prefill(tokens)
    elapsed = time.perf_counter() - started
    for b in reversed(branches):
        await b.prune()
    return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "gemma3"))
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    template = None if args.model == "smollm2" else "gemma"  # the Gemma test model has none
    async with await lloyal.create_context(
        model_path(args.model), n_ctx=4096, n_seq_max=args.n, mmproj=fixtures.mmproj(args.model)
    ) as ctx:
        await run(ctx, "N encodes", 2, 0, template)  # warm-up
        seconds: dict[str, list[float]] = {s: [] for s in SETUPS}
        for r in range(args.rounds):
            for setup in SETUPS:
                seconds[setup].append(await run(ctx, setup, args.n, 1 + r, template))
        encodes = ctx.stats.media_encodes
    base = statistics.median(seconds["N encodes"])
    print(f"{args.model}: N={args.n}, median of {args.rounds} rounds, {encodes} encodes in all")
    print(f"{'setup':<18} {'seconds':>8} {'speed-up':>9}")
    for setup in SETUPS:
        s = statistics.median(seconds[setup])
        print(f"{setup:<18} {s:8.3f} {base / s:8.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
