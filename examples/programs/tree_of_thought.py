"""Tree of thought: at each level, fork the state into a few candidate next
thoughts, let the model rate each one (a ``select`` over ratings, scored in
one decode), keep the best, and go on from it."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path

RATINGS = [" good", " bad"]


@lloyal.program
async def think(s: lloyal.ProgramState, problem: str, width: int, depth: int) -> str:
    s += f"Problem: {problem}\nLet us think step by step.\n"
    for level in range(depth):
        thoughts = await s.fork(width)
        await asyncio.gather(
            *(t.gen("thought", max_tokens=24, temperature=0.9, stop="\n") for t in thoughts)
        )
        scores = []
        for t in thoughts:
            t += "\nIs this step good or bad? It is"
            await t.select("rating", RATINGS)
            good, _ = t.scores["rating"][0]
            scores.append(good)
        best = max(range(width), key=scores.__getitem__)
        step = thoughts[best]["thought"].strip()
        print(f"level {level}: kept {best} of {width}: {step!r}")
        await s.join(thoughts)
        s += step + "\n"
    await s.gen("answer", max_tokens=24, stop="\n")
    return str(s["answer"]).strip()


async def run(problem: str, model: str | None, width: int, depth: int, seed: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=2 * width + 1
    ) as ctx:
        state = await think.run(ctx, problem, width, depth, params=lloyal.SamplingParams(seed=seed))
        print(f"answer: {state.result!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("problem", nargs="?", default="How many legs do three cats have?")
    parser.add_argument("--model")
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(run(args.problem, args.model, args.width, args.depth, args.seed))


if __name__ == "__main__":
    main()
