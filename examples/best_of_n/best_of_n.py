"""Best-of-N: N sampled answers in lockstep, the least perplexed wins (see README.md)."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path
from lloyal.strategies import best_of_n


async def run(prompt: str, model: str | None, n: int, max_tokens: int, seed: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=n + 1
    ) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": prompt}])
        result = await best_of_n(
            ctx,
            chat.prompt,
            n=n,
            max_tokens=max_tokens,
            params=lloyal.SamplingParams(temperature=0.9, seed=seed),
            seed=seed,
            stop=chat.stop_tokens,
        )
        for i, c in enumerate(result.candidates):
            mark = "*" if i == result.best_index else " "
            print(f"{mark} [{i}] perplexity {c.perplexity:6.2f}  {c.text.strip()!r}")
        generated = sum(len(c.tokens) for c in result.candidates)
        print(
            f"\nwinner: candidate {result.best_index}; {generated} tokens from {n} branches in "
            f"{result.decode_calls} decode calls ({result.seconds:.1f}s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Write a one-line motto for a lighthouse.")
    parser.add_argument("--model")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(run(args.prompt, args.model, args.n, args.max_tokens, args.seed))


if __name__ == "__main__":
    main()
