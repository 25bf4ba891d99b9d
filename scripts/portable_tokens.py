"""Print, as JSON, the CPU variant llama.cpp chose and a few greedy tokens.

Run by scripts/check_portable.sh natively and under qemu-user emulating an
older CPU; the two outputs are compared there.

    python scripts/portable_tokens.py MODEL.gguf [--tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import lloyal

# Counting: every step's winner leads by several logits (see top1_margins),
# so two CPUs' kernels, which round differently, still agree on each token.
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


async def main(model: str, n: int) -> dict[str, object]:
    async with await lloyal.create_context(model, n_ctx=256, n_threads=1) as ctx:
        prompt = await ctx.tokenize(PROMPT)
        await ctx.decode(prompt, 0)
        tokens: list[int] = []
        margins: list[float] = []
        for pos in range(len(prompt), len(prompt) + n):
            logits = ctx.get_logits()
            top2 = sorted(logits.tolist(), reverse=True)[:2]
            margins.append(round(top2[0] - top2[1], 3))
            tok = ctx.greedy_sample()
            tokens.append(tok)
            await ctx.decode([tok], pos)
        text = await ctx.detokenize(tokens)
    info = lloyal.backend_info()
    return {
        "cpu_variant": info.cpu_variant,
        "cpu_features": " ".join(info.cpu_features),
        "tokens": tokens,
        "text": text,
        # How far the winner led at each step: a small margin is where two
        # CPUs' kernels could round a tie differently.
        "top1_margins": margins,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.model, args.tokens))))
