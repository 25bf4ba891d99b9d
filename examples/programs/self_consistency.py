"""Self-consistency: fork N reasoning paths from one prompt, sample an answer
on each (the forks share one decode per step), and take the majority vote."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

import lloyal
from lloyal.models import default_model_path


@lloyal.program
async def vote(s: lloyal.ProgramState, question: str, n: int, max_tokens: int) -> str:
    s += lloyal.user(question + " Answer with a number.")
    s += lloyal.assistant()
    paths = await s.fork(n)
    await asyncio.gather(
        *(p.gen("answer", max_tokens=max_tokens, temperature=0.8, stop="\n") for p in paths)
    )
    answers = [p["answer"].strip() for p in paths]
    await s.join(paths)
    winner, count = Counter(answers).most_common(1)[0]
    print("\n".join(f"  [{i}] {a!r}" for i, a in enumerate(answers)))
    print(f"majority ({count} of {n}): {winner!r}")
    return winner


async def run(question: str, model: str | None, n: int, max_tokens: int, seed: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=n + 1
    ) as ctx:
        before = ctx.stats.decode_calls
        await vote.run(ctx, question, n, max_tokens, params=lloyal.SamplingParams(seed=seed))
        print(f"{ctx.stats.decode_calls - before} decode calls for {n} paths")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("question", nargs="?", default="What is 12 + 30?")
    parser.add_argument("--model")
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(run(args.question, args.model, args.n, args.max_tokens, args.seed))


if __name__ == "__main__":
    main()
