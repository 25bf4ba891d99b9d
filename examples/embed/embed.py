"""Similarity search with embeddings: rank documents against a query (see README.md)."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path

DOCUMENTS = [
    "The Rhine flows from the Swiss Alps to the North Sea.",
    "Sourdough bread needs a starter of flour and water.",
    "The Danube passes through four capital cities.",
    "A good espresso takes about 25 seconds to pull.",
    "Glaciers feed many of Europe's great rivers.",
    "Proofing dough in a warm place helps it rise.",
]


async def run(query: str, model: str | None, top: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), embeddings=True, n_seq_max=8
    ) as ctx:
        before = ctx.stats.decode_calls
        docs = await ctx.embed(DOCUMENTS)  # one row per document, unit length
        calls = ctx.stats.decode_calls - before
        q = await ctx.embed(query)
        scores = docs @ q  # cosine similarity
        print(f"query: {query!r}  ({len(DOCUMENTS)} documents embedded in {calls} decode call(s))")
        for i in scores.argsort()[::-1][:top]:
            print(f"  {scores[i]:.3f}  {DOCUMENTS[i]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("query", nargs="?", default="Which rivers run through Europe?")
    parser.add_argument("--model")
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.query, args.model, args.top))


if __name__ == "__main__":
    main()
