"""Entropy-aware generation with the flat decode loop (see README.md)."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path


async def generate(
    prompt: str, model: str | None, template: str | None, max_tokens: int, seed: int
) -> str:
    async with await lloyal.create_context(model or default_model_path(), n_ctx=1024) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": prompt}], template=template)
        tokens = await ctx.tokenize(chat.prompt, add_special=False)
        await ctx.decode(tokens, 0)
        base = lloyal.SamplingParams(temperature=0.7, seed=seed)
        stream, ppl, pos, cooled = (
            lloyal.TextStream(ctx),
            ctx.create_perplexity_tracker(),
            len(tokens),
            0,
        )
        text = []
        for _ in range(max_tokens):
            guessing = ctx.model_entropy("bits") > 4.0
            cooled += guessing
            token = ctx.sample(base.with_(temperature=0.2) if guessing else base)
            if token in chat.stop_tokens or ctx.is_stop_token(token):
                break
            ppl.add(ctx.model_surprisal(token))
            piece = stream.push(token)
            text.append(piece)
            print(piece, end="", flush=True)
            await ctx.decode([token], pos)
            pos += 1
        text.append(stream.flush())
        print(f"\n[{ppl.count} tokens, perplexity {ppl.perplexity:.2f}, {cooled} cooled steps]")
        return "".join(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Name three rivers in Europe.")
    parser.add_argument("--model")
    parser.add_argument("--template")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(generate(args.prompt, args.model, args.template, args.max_tokens, args.seed))


if __name__ == "__main__":
    main()
