"""Generating past the context window with clear_and_reseed (see README.md)."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path


async def run(
    prompt: str,
    model: str | None,
    window: int | None,
    max_tokens: int,
    sinks: int,
    tail: int,
    seed: int,
) -> None:
    async with await lloyal.create_context(model or default_model_path(), n_ctx=256) as ctx:
        limit = min(window or ctx.n_ctx, ctx.n_ctx)
        chat = ctx.format_chat([{"role": "user", "content": prompt}])
        prompt_tokens = await ctx.tokenize(chat.prompt)
        if sinks + tail >= limit or len(prompt_tokens) >= limit:
            raise SystemExit("the window must hold the prompt and sinks + tail")
        await ctx.decode(prompt_tokens, 0)
        params = lloyal.SamplingParams(temperature=0.8, repeat_penalty=1.15, seed=seed)
        stream, total, segment = (
            lloyal.TextStream(ctx),
            ctx.create_perplexity_tracker(),
            ctx.create_perplexity_tracker(),
        )
        history, pos, reseeds = list(prompt_tokens), len(prompt_tokens), 0
        for _ in range(max_tokens):
            token = ctx.sample(params)
            if ctx.is_stop_token(token):
                break
            s = ctx.model_surprisal(token)
            total.add(s)
            segment.add(s)
            history.append(token)
            print(stream.push(token), end="", flush=True)
            if pos + 1 >= limit:
                # Window full: keep the first tokens (attention sinks) and the
                # most recent ones, re-decoded at contiguous positions. The
                # new token is the tail's last; its logits come back too.
                reseeds += 1
                print(
                    f"\n[reseed {reseeds}: window full at {pos + 1} tokens; "
                    f"perplexity since last {segment.perplexity:.2f}]",
                    flush=True,
                )
                segment.reset()
                await ctx.clear_and_reseed(history[:sinks], history[-tail:])
                pos = sinks + tail
            else:
                await ctx.decode([token], pos)
                pos += 1
        print(stream.flush())
        print(
            f"\n[{total.count} tokens generated in a {limit}-token window, {reseeds} reseeds, "
            f"perplexity {total.perplexity:.2f}]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Tell me a long story about a lighthouse.")
    parser.add_argument("--model")
    parser.add_argument("--window", type=int, help="tokens before a reseed (default: n_ctx, 256)")
    parser.add_argument("--max-tokens", type=int, default=600)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--tail", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(
        run(args.prompt, args.model, args.window, args.max_tokens, args.sinks, args.tail, args.seed)
    )


if __name__ == "__main__":
    main()
