"""Beam search next to greedy decoding (see README.md)."""

from __future__ import annotations

import argparse
import asyncio

import lloyal
from lloyal.models import default_model_path
from lloyal.strategies import beam_search, generate


async def run(prompt: str, model: str | None, width: int, max_tokens: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=4 * width
    ) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": prompt}])
        greedy = await generate(ctx, chat.prompt, max_tokens=max_tokens, stop=chat.stop_tokens)
        beams = await beam_search(
            ctx, chat.prompt, width=width, max_tokens=max_tokens, stop=chat.stop_tokens
        )
        print(f"greedy          log p {greedy.output.log_prob:7.2f}  {greedy.text.strip()!r}")
        for i, b in enumerate(beams.beams):
            state = "done" if b.stopped else "open"
            print(f"beam {i} ({state})  log p {b.log_prob:7.2f}  {b.text.strip()!r}")
        print(
            f"\n[width {width}: {beams.decode_calls} decode calls, "
            f"{beams.peak_leases} KV leases at most, {beams.seconds:.1f}s]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Complete the proverb: an apple a day")
    parser.add_argument("--model")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    asyncio.run(run(args.prompt, args.model, args.width, args.max_tokens))


if __name__ == "__main__":
    main()
