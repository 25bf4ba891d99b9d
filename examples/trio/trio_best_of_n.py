"""Best-of-N under trio: one task per candidate, commits batched (see README.md)."""

from __future__ import annotations

import argparse

import lloyal
import trio
from lloyal.models import default_model_path


async def candidate(branch: lloyal.Branch, max_tokens: int, out: list[int]) -> None:
    # Each task runs its own loop. Commits made by tasks in the same
    # scheduling round are coalesced into one llama_decode.
    for _ in range(max_tokens):
        p = await branch.produce()
        if p.is_stop:
            return
        await branch.commit(p.token)
        out.append(p.token)


async def run(prompt: str, model: str | None, n: int, max_tokens: int) -> None:
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=2048, n_seq_max=n + 1
    ) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": prompt}])
        root = lloyal.Branch.create(ctx, params=lloyal.SamplingParams(temperature=0.9))
        async with root:  # prunes the root and every fork on exit
            await root.prefill(await ctx.tokenize(chat.prompt))
            branches = [await root.fork() for _ in range(n)]
            for i, b in enumerate(branches):
                b.reseed_sampler(i)
            outputs: list[list[int]] = [[] for _ in branches]
            before = ctx.stats.decode_calls
            async with trio.open_nursery() as nursery:
                for b, out in zip(branches, outputs, strict=True):
                    nursery.start_soon(candidate, b, max_tokens, out)
            decodes = ctx.stats.decode_calls - before
            best = min(range(n), key=lambda i: branches[i].perplexity)
            for i, (b, out) in enumerate(zip(branches, outputs, strict=True)):
                mark = "*" if i == best else " "
                text = await ctx.detokenize(out)
                print(f"{mark} [{i}] perplexity {b.perplexity:6.2f}  {text.strip()!r}")
            total = sum(map(len, outputs))
            print(f"\n[{n} trio tasks, {total} tokens, {decodes} decode calls]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Write a one-line motto for a lighthouse.")
    parser.add_argument("--model")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    trio.run(run, args.prompt, args.model, args.n, args.max_tokens)


if __name__ == "__main__":
    main()
