"""A small Monte Carlo tree search over tokens, steered by a score (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import re

import lloyal
from lloyal.models import default_model_path
from lloyal.strategies import TreeNode, mcts


def alliteration(text: str) -> float:
    """The share of words that start with 's' (the thing we search for)."""
    words = re.findall(r"[a-zA-Z]+", text)
    return sum(w[0].lower() == "s" for w in words) / len(words) if words else 0.0


def show(nodes: tuple[TreeNode, ...], depth: int = 0) -> None:
    for n in sorted(nodes, key=lambda n: -n.visits):
        print(f"{'  ' * depth}{n.text!r:<14} visits {n.visits:2d}  mean score {n.value:.2f}")
        show(n.children, depth + 1)


async def run(prompt: str, model: str | None, iterations: int, width: int, rollout: int) -> None:
    leases = iterations * (width - 1) + width + 1
    async with await lloyal.create_context(
        model or default_model_path(), n_ctx=4096, n_seq_max=leases
    ) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": prompt}])
        result = await mcts(
            ctx,
            chat.prompt,
            alliteration,
            iterations=iterations,
            width=width,
            rollout_tokens=rollout,
            stop=chat.stop_tokens,
        )
        show(result.roots)
        print(f"\nbest (score {result.score:.2f}): {result.text.strip()!r}")
        print(
            f"[{result.iterations} iterations, {result.rollouts} rollouts, "
            f"{result.decode_calls} decode calls, {result.seconds:.1f}s]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Describe the sea in one sentence.")
    parser.add_argument("--model")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--width", type=int, default=3)
    parser.add_argument("--rollout-tokens", type=int, default=16)
    args = parser.parse_args()
    asyncio.run(run(args.prompt, args.model, args.iterations, args.width, args.rollout_tokens))


if __name__ == "__main__":
    main()
