"""A JSON extraction batch: one program, many inputs, run together with
``run_batch`` (their decodes shared), each output constrained by a schema."""

from __future__ import annotations

import argparse
import asyncio
import json

import lloyal
from lloyal.models import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

PEOPLE = [
    "Ada is a 36 year old engineer.",
    "Bob, aged 52, runs the bakery.",
    "The violinist Chiara turned 29 last week.",
    "Dmitri (41) teaches chemistry.",
    "Eve is seventy years old and still climbs.",
    "Farid, 18, just started university.",
]


@lloyal.program
async def extract(s: lloyal.ProgramState, sentence: str) -> dict[str, object]:
    s += f"Sentence: {sentence}\nThe person as JSON with name and age:\n"
    text = await s.gen("json", json_schema=SCHEMA, max_tokens=40)
    return dict(json.loads(text))


async def run(model: str | None, concurrency: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=4096, n_seq_max=concurrency
    ) as ctx:
        before = ctx.stats.decode_calls
        states = await extract.run_batch(ctx, PEOPLE, concurrency=concurrency, params=lloyal.GREEDY)
        for sentence, state in zip(PEOPLE, states, strict=True):
            print(f"{sentence!r:48} -> {json.dumps(state.result)}")
        print(f"{len(PEOPLE)} inputs in {ctx.stats.decode_calls - before} decode calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--concurrency", type=int, default=6)
    args = parser.parse_args()
    asyncio.run(run(args.model, args.concurrency))


if __name__ == "__main__":
    main()
