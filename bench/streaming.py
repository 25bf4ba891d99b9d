"""Perplexity of a document four times the context, three ways.

A context large enough for the whole document gives the baseline; a small
context streams it with BlinkKV reseeding (4 sink tokens plus the most
recent half of the context, re-decoded at contiguous positions) and with
naive eviction (the oldest cells dropped, positions counting on). Printed
side by side, as ratios to the baseline, for each model.

    python bench/streaming.py [--models smollm2,gemma3] [--n-ctx 256] [--times 4]

The document is the GNU GPL v3 text every Debian machine has (with
CPython's licence as a fallback). The Node.js library this one follows
reports reseeding within 3-16% of the baseline and naive eviction 1.15x to
198x worse, depending on the architecture.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import lloyal
from lloyal.models import model_path
from lloyal.streaming import Policy, stream_perplexity


def document() -> str:
    import os
    import sys

    for path in (
        "/usr/share/common-licenses/GPL-3",
        os.path.join(
            sys.base_prefix,
            "lib",
            f"python{sys.version_info[0]}.{sys.version_info[1]}",
            "LICENSE.txt",
        ),
    ):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise SystemExit("no long English document found (GPL-3 or CPython's LICENSE.txt)")


async def three_ways(name: str, n_ctx: int, times: int) -> dict[str, float]:
    out: dict[str, float] = {}
    async with await lloyal.create_context(model_path(name), n_ctx=n_ctx) as small:
        tokens = (await small.tokenize(document()))[: times * small.n_ctx]
        policies: tuple[Policy, ...] = ("reseed", "evict")
        for policy in policies:
            started = time.perf_counter()
            out[policy] = await stream_perplexity(small, tokens, policy=policy)
            out[f"{policy}_s"] = time.perf_counter() - started
        out["n_ctx"] = small.n_ctx
    async with await lloyal.create_context(model_path(name), n_ctx=len(tokens) + 8) as big:
        out["baseline"] = await stream_perplexity(big, tokens, policy="none")
    out["tokens"] = len(tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--times", type=int, default=4, help="document length in multiples of n_ctx")
    args = ap.parse_args()
    print(f"{'model':10} {'tokens':>6} {'n_ctx':>5} {'baseline':>9} {'reseed':>15} {'evict':>17}")
    for name in args.models.split(","):
        r = asyncio.run(three_ways(name, args.n_ctx, args.times))
        b = r["baseline"]
        reseed, evict = r["reseed"], r["evict"]
        print(
            f"{name:10} {int(r['tokens']):6d} {int(r['n_ctx']):5d} {b:9.3f} "
            f"{reseed:8.3f} ({reseed / b:4.2f}x) {evict:9.3f} ({evict / b:5.2f}x)"
        )


if __name__ == "__main__":
    main()
