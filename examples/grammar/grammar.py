"""JSON-schema-constrained generation, and forking at a choice point (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import json

import lloyal
from lloyal.models import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "mood": {"enum": ["calm", "busy", "sleepy"]},
        "why": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "mood", "why"],
    "additionalProperties": False,
}


async def run(model: str | None, max_tokens: int) -> None:
    async with await lloyal.create_context(model or default_model_path(), n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY, json_schema=SCHEMA)
        await root.prefill(await ctx.tokenize("Describe a city as JSON: "))
        # Generate up to the choice point: the opening quote of "mood".
        prefix: list[int] = []
        while not (await ctx.detokenize(prefix)).endswith('"mood": "'):
            p = await root.produce()
            if p.is_stop or len(prefix) >= max_tokens:
                raise SystemExit("the model never reached the mood field")
            await root.commit(p.token)
            prefix.append(p.token)
        print(f"shared prefix: {await ctx.detokenize(prefix)}")
        # Fork once per enum value; each fork is forced to its value and
        # completes on its own. The grammar state forks with the branch.
        for mood in SCHEMA["properties"]["mood"]["enum"]:  # type: ignore[index]
            async with await root.fork() as child:
                forced = await ctx.tokenize(mood, add_special=False)
                for t in forced:
                    await child.commit(t)
                rest = []
                async for tok in child:
                    rest.append(tok.token)
                    if len(rest) >= max_tokens:
                        break
                text = await ctx.detokenize(prefix + forced + rest)
                doc = json.loads(text)
                print(f"{mood:>6}: {json.dumps(doc)}  (perplexity {child.perplexity:.2f})")
        await root.prune()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(run(args.model, args.max_tokens))


if __name__ == "__main__":
    main()
