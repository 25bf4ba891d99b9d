"""The checks of test_determinism.py, run in a fresh interpreter: a
deterministic context must be set up before anything in the process
decodes (llama.cpp reads GGML_CPU_TILED_MM once per process), and the rest
of the suite has decoded long before. Usage::

    python determinism_child.py MODEL_PATH CHECK

prints one JSON object. Each check reports raw measurements (largest
absolute logit differences, token lists); the test decides.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import lloyal
import numpy as np
from lloyal import strategies

PROMPT = "The quick brown fox jumps over the lazy dog. Then"
TOKENS = [100 + 37 * i for i in range(8)]


def open_ctx(path: str, **kwargs: Any) -> Awaitable[lloyal.Context]:
    kwargs.setdefault("n_ctx", 1024)
    return lloyal.create_context(path, deterministic=True, **kwargs)


def diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


async def batch(path: str) -> dict[str, Any]:
    """Eight forks each commit one token: one at a time, all together, all
    together in reverse order (every fork at another row)."""

    async def run(order: str) -> list[np.ndarray]:
        async with await open_ctx(path, n_seq_max=9) as ctx:
            root = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await root.prefill(await ctx.tokenize(PROMPT))
            kids = [await root.fork() for _ in TOKENS]
            pairs = list(zip(kids, TOKENS, strict=True))
            if order == "alone":
                for kid, token in pairs:
                    await kid.commit(token)
            else:
                await lloyal.BranchStore(ctx).commit(pairs if order == "batch" else pairs[::-1])
            return [kid.logits.copy() for kid in kids]

    alone = await run("alone")
    return {
        order: [diff(a, b) for a, b in zip(alone, await run(order), strict=True)]
        for order in ("batch", "reversed")
    }


async def split(path: str) -> dict[str, Any]:
    """A prompt prefilled in one call, or in calls of 1, 7 and 64 tokens."""

    async def run(step: int) -> np.ndarray:
        async with await open_ctx(path) as ctx:
            tokens = await ctx.tokenize("The quick brown fox jumps over the lazy dog. " * 8)
            b = lloyal.Branch.create(ctx, lloyal.GREEDY)
            for i in range(0, len(tokens), step):
                await b.prefill(tokens[i : i + step])
            return b.logits.copy()

    one = await run(10_000)
    return {str(step): diff(one, await run(step)) for step in (1, 7, 64)}


async def reused_cells(path: str) -> dict[str, Any]:
    """A branch continues into cells a pruned branch freed *before* its
    prefix (llama.cpp's slot search wraps to the start), against the same
    tokens decoded into a fresh cache."""
    prompt_text = "Once upon a time, in a small village by the sea,"
    more = [TOKENS[0], TOKENS[1], TOKENS[2], TOKENS[3]]

    async def run(reuse: bool) -> list[np.ndarray]:
        async with await open_ctx(path, n_seq_max=2) as ctx:
            if reuse:
                filler = lloyal.Branch.create(ctx, lloyal.GREEDY)
                await filler.prefill(await ctx.tokenize(PROMPT * 6))
            b = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await b.prefill(await ctx.tokenize(prompt_text))
            if reuse:
                await filler.prune()
            out = []
            for t in more:
                await b.commit(t)
                out.append(b.logits.copy())
            return out

    return {"steps": [diff(a, b) for a, b in zip(await run(False), await run(True), strict=True)]}


async def purge(path: str) -> dict[str, Any]:
    """Dropped cells are kept (as tombstones) until the cache is full; then
    they are freed and the decode goes on."""
    async with await open_ctx(path, n_ctx=256, n_seq_max=2) as ctx:
        third = (TOKENS * 16)[: ctx.n_ctx // 3 + 1]
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(third)
        side = await b.fork()
        await side.prefill(third)
        await side.prune()  # its cells are tombstones: two thirds are taken
        before = ctx.stats.tombstone_purges
        await b.prefill(third)  # more than the free third
        return {
            "purges": ctx.stats.tombstone_purges - before,
            "position": b.position == 2 * len(third),
        }


async def four_branches(path: str) -> dict[str, Any]:
    """The README-branch-store example: four forks scatter-prefilled with
    prefixes of different lengths in one call, then greedy steps in
    lockstep, one BranchStore.commit per step; against each branch run
    alone in a context of its own."""
    question = "Explain quantum entanglement"
    prefixes = [
        "Think of it like two coins",
        "In quantum mechanics, the",
        "What happens when you measure",
        "Imagine two particles",
    ]
    steps = 6

    async def together() -> list[list[np.ndarray]]:
        async with await open_ctx(path, n_seq_max=5) as ctx:
            root = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await root.prefill(await ctx.tokenize(question))
            branches = [await root.fork() for _ in prefixes]
            store = lloyal.BranchStore(ctx)
            await store.prefill(
                [
                    (b, await ctx.tokenize(p, add_special=False))
                    for b, p in zip(branches, prefixes, strict=True)
                ]
            )
            seen = [[b.logits.copy()] for b in branches]
            for _ in range(steps):
                picks = [(b, (await b.produce()).token) for b in branches]
                await store.commit(picks)
                for row, b in zip(seen, branches, strict=True):
                    row.append(b.logits.copy())
            return seen

    async def alone(prefix: str) -> list[np.ndarray]:
        async with await open_ctx(path) as ctx:
            b = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await b.prefill(await ctx.tokenize(question))
            await b.prefill(await ctx.tokenize(prefix, add_special=False))
            seen = [b.logits.copy()]
            for _ in range(steps):
                await b.commit((await b.produce()).token)
                seen.append(b.logits.copy())
            return seen

    both = await together()
    return {
        "branches": [
            [diff(x, y) for x, y in zip(row, await alone(p), strict=True)]
            for row, p in zip(both, prefixes, strict=True)
        ]
    }


async def embeddings(path: str) -> dict[str, Any]:
    texts = [
        "The cat sat on the mat.",
        "A kitten rested on the rug.",
        "Stock markets fell sharply today.",
        "Investors sold shares as prices dropped.",
    ]
    async with await open_ctx(path, embeddings=True, n_seq_max=4) as ctx:
        batched = await ctx.embed(texts)
        singles = np.stack([await ctx.embed(t) for t in texts])
    # The mode pools in lloyal; llama.cpp's own pooling points the same way.
    async with await lloyal.create_context(path, embeddings=True, n_seq_max=4) as ctx:
        usual = await ctx.embed(texts)
    return {
        "rows": [diff(a, b) for a, b in zip(batched, singles, strict=True)],
        "cosine_to_usual": float(np.min(np.sum(batched * usual, axis=1))),
    }


PROMPTS = [
    "Write a short poem about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three colors.",
    "What is 12 times 7?",
    "Tell me a joke about cats.",
    "Describe a sunrise.",
    "Give advice to a new programmer.",
    "Summarize the plot of Cinderella.",
    "Name a famous scientist and why.",
    "How do airplanes fly?",
]


def second_best_drafts() -> None:
    """Make the model drafter propose its *second* choice, with its first
    as the sibling: the target's token is then always a sibling's, so tree
    verification has to take the path through the siblings."""
    drafter = strategies._speculative._ModelDrafter
    propose = drafter.propose

    async def swapped(self: Any, history: Any, k: int, *args: Any, **kwargs: Any) -> Any:
        _, probs = await propose(self, history, 1, *args, **kwargs)
        q = probs[0]
        assert q is not None
        first, second = (int(i) for i in np.argsort(-q)[:2])
        q = q.copy()
        q[first], q[second] = q[second], q[first]
        return [second], [q]

    drafter.propose = swapped  # type: ignore[method-assign]


async def speculation(path: str) -> dict[str, Any]:
    """Plain greedy decoding against draft-model, tree and prompt-lookup
    speculation, with the model drafting for itself."""
    out: dict[str, Any] = {}
    async with (
        await open_ctx(path, n_ctx=2048, n_seq_max=4) as target,
        await open_ctx(path, n_ctx=2048) as draft,
    ):
        template = None if target.model_info.has_chat_template else "gemma"
        chats = [
            target.format_chat([{"role": "user", "content": p}], template=template) for p in PROMPTS
        ]

        async def each(run: Callable[[Any], Awaitable[Any]]) -> list[Any]:
            return [await run(chat) for chat in chats]

        def spec(**kw: Any) -> Callable[[Any], Awaitable[Any]]:
            return lambda chat: strategies.speculative_decode(
                target, chat.prompt, k=4, max_tokens=16, stop=chat.stop_tokens, **kw
            )

        plain = await each(
            lambda chat: strategies.generate(
                target, chat.prompt, max_tokens=16, stop=chat.stop_tokens
            )
        )
        out["plain"] = [r.tokens for r in plain]
        for name, run in {
            "draft": spec(draft=draft),
            "tree": spec(draft=draft, width=3, confidence=1.0),
            "lookup": spec(),
        }.items():
            results = await each(run)
            out[name] = [r.tokens for r in results]
            out[name + "_acceptance"] = [r.acceptance_rate for r in results]
            out[name + "_verified_per_round"] = [r.verified / r.rounds for r in results]
        second_best_drafts()
        results = await each(spec(draft=draft, width=2, confidence=1.0))
        out["sibling"] = [r.tokens for r in results]
        out["sibling_accepted"] = [r.accepted for r in results]
        out["leases_left"] = lloyal.BranchStore(target).available
    return out


CHECKS: dict[str, Callable[[str], Awaitable[dict[str, Any]]]] = {
    "batch": batch,
    "split": split,
    "reused_cells": reused_cells,
    "four_branches": four_branches,
    "purge": purge,
    "embeddings": embeddings,
    "speculation": speculation,
}


if __name__ == "__main__":
    model, check = sys.argv[1], sys.argv[2]
    assert Path(model).is_file(), model
    print(json.dumps(asyncio.run(CHECKS[check](model))))
