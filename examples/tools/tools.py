"""A tool-calling conversation on a Session (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import lloyal
from lloyal.models import default_model_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def get_weather(city: str, unit: str) -> dict[str, Any]:
    """A stand-in for a real weather service."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "sky": "clear"}


async def main(model: str | None, template: str | None, question: str, max_tokens: int) -> None:
    # tool_choice="required": a 135M model seldom decides to call a tool on
    # its own; the grammar makes its first answer a valid call.
    async with (
        await lloyal.create_context(model or default_model_path(), n_ctx=4096) as ctx,
        await lloyal.Session.create(
            ctx,
            params=lloyal.SamplingParams(temperature=0.2, seed=0),
            template=template,
            tools=[WEATHER],
            tool_choice="required",
        ) as session,
    ):
        await session.add_user(question)
        reply = await session.reply(max_tokens=max_tokens)
        for call in reply.tool_calls:
            args = call.parsed_arguments() or {}
            print(f"call: {call.name}({json.dumps(args)})")
            result = get_weather(**args)
            print(f"result: {json.dumps(result)}")
            await session.add_tool_result(json.dumps(result), name=call.name)
        # Now an answer in prose: the same prompt, no grammar this time.
        answer = await session.reply(max_tokens=max_tokens, constrain=False)
        print(f"answer: {answer.content.strip()}")
        print(
            f"decoded {session.tokens_decoded} tokens in all; "
            f"the context holds {session.branch.position}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    parser.add_argument("--model")
    parser.add_argument("--template")
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args()
    asyncio.run(main(args.model, args.template, args.question, args.max_tokens))
