"""Grammar-constrained decoding speed next to unconstrained, in one run.

Each round generates the same number of greedy tokens twice on one branch
setup: once free, once under a JSON schema (llguidance computes a token
mask per step and the branch samples from the masked logits). Rounds
alternate so machine noise hits both; medians and their ratio are printed.
Fork latency is measured the same way, for a branch with and without a
grammar (a fork clones the matcher).

    python bench/grammar.py [--model smollm2|gemma3|PATH] [--tokens 64] [--rounds 5]

Target: constrained >= 0.9x unconstrained tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import lloyal
from lloyal.models import KNOWN_MODELS, model_path

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 60},
            "maxItems": 50,
        }
    },
    "required": ["notes"],
}
PROMPT = "Write notes about rivers of Europe as JSON: "


async def generate(ctx: lloyal.Context, prompt: list[int], n: int, **grammar: Any) -> float:
    """tok/s of n greedy produce+commit steps (a stop token ends early)."""
    async with lloyal.Branch.create(ctx, lloyal.GREEDY, **grammar) as b:
        await b.prefill(prompt)
        done = 0
        started = time.perf_counter()
        for _ in range(n):
            p = await b.produce()
            if p.is_stop:
                break
            await b.commit(p.token)
            done += 1
        return done / (time.perf_counter() - started)


async def fork_micros(ctx: lloyal.Context, prompt: list[int], reps: int, **grammar: Any) -> float:
    async with lloyal.Branch.create(ctx, lloyal.GREEDY, **grammar) as root:
        await root.prefill(prompt)
        if grammar:  # move the matcher past the start, as in real use
            for _ in range(8):
                await root.commit((await root.produce()).token)
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            child = await root.fork()
            times.append(time.perf_counter() - started)
            await child.prune()
        return statistics.median(times) * 1e6


async def main(path: str, n: int, rounds: int) -> None:
    async with await lloyal.create_context(path, n_ctx=2048, n_seq_max=4) as ctx:
        prompt = await ctx.tokenize(PROMPT)
        started = time.perf_counter()
        ctx.create_grammar(json_schema=SCHEMA)
        first_compile = time.perf_counter() - started
        free, constrained = [], []
        for _ in range(rounds):
            free.append(await generate(ctx, prompt, n))
            constrained.append(await generate(ctx, prompt, n, json_schema=SCHEMA))
        f, c = statistics.median(free), statistics.median(constrained)
        long_prompt = (await ctx.tokenize("word " * 300))[:256]
        fork_free = await fork_micros(ctx, long_prompt, 50)
        fork_grammar = await fork_micros(ctx, long_prompt, 50, json_schema=SCHEMA)
        print(f"model: {path}")
        print(f"first grammar compile (vocabulary index + schema): {first_compile * 1e3:.0f} ms")
        print(f"unconstrained  {f:7.1f} tok/s")
        print(f"constrained    {c:7.1f} tok/s   ratio {c / f:.3f}x  (target >= 0.9x)")
        print(
            f"fork, 256-token prefix: {fork_free:6.0f} us free, {fork_grammar:6.0f} us with grammar"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help=f"{', '.join(KNOWN_MODELS)} or a path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = str(model_path(args.model)) if args.model in KNOWN_MODELS else args.model
    asyncio.run(main(path, args.tokens, args.rounds))
