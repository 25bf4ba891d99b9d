"""A tool-using agent as a program: the model picks a tool with ``select``
(every tool name scored in one decode), writes its arguments under a JSON
schema, the program runs the tool and appends the result, and the model
answers from it."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

import lloyal
from lloyal.models import default_model_path


def add(a: int, b: int) -> int:
    return a + b


def multiply(a: int, b: int) -> int:
    return a * b


TOOLS: dict[str, Callable[..., Any]] = {"add": add, "multiply": multiply}
ARGS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@lloyal.program
async def agent(s: lloyal.ProgramState, question: str) -> str:
    s += "Tools: add(a, b), multiply(a, b).\n"
    s += f"Question: {question}\nTool:"
    tool = (await s.select("tool", [" " + name for name in TOOLS])).strip()
    s += "\nArguments (JSON): "
    args = json.loads(await s.gen("args", json_schema=ARGS, max_tokens=24))
    result = TOOLS[tool](**args)
    print(f"calls {tool}({args['a']}, {args['b']}) -> {result}")
    s += f"\nResult: {result}\nAnswer:"
    await s.gen("answer", max_tokens=16, stop="\n")
    return str(s["answer"]).strip()


async def run(question: str, model: str | None) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=len(TOOLS)
    ) as ctx:
        state = await agent.run(ctx, question, params=lloyal.GREEDY)
        print(f"answer: {state.result!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("question", nargs="?", default="What is 6 plus 7?")
    parser.add_argument("--model")
    args = parser.parse_args()
    asyncio.run(run(args.question, args.model))


if __name__ == "__main__":
    main()
