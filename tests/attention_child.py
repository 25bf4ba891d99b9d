"""One scenario of test_attention.py, run in a fresh interpreter so that the
flash attention switch (``GGML_CPU_DISABLE_FA_SPARSE``, read once per
process by the patched llama.cpp) applies to it. Usage::

    python attention_child.py MODEL_PATH SCENARIO

prints one JSON object: for each decode step, one entry per branch with the
sha256 of its logits' bytes, its greedy token and its logits at a fixed
sample of token ids (to measure how far two runs are apart). The test
decides what must match.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import lloyal
import numpy as np

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog woke up and"
SAMPLE = 256


def row(logits: np.ndarray) -> dict[str, Any]:
    x = np.ascontiguousarray(logits, dtype=np.float32)
    step = max(1, x.size // SAMPLE)
    return {
        "sha": hashlib.sha256(x.tobytes()).hexdigest(),
        "argmax": int(np.argmax(x)),
        "sample": [float(v) for v in x[::step][:SAMPLE]],
    }


def token(i: int, step: int) -> int:
    return 100 + 37 * i + 11 * step


async def lockstep(ctx: lloyal.Context, kids: list[lloyal.Branch], steps: int) -> list[Any]:
    """``steps`` rounds in which every branch commits its own token, all of a
    round in one ``BranchStore.commit`` (one decode)."""
    store = lloyal.BranchStore(ctx)
    out = []
    for step in range(steps):
        await store.commit([(kid, token(i, step)) for i, kid in enumerate(kids)])
        out.append([row(kid.logits) for kid in kids])
    return out


def forks(n: int) -> Callable[[str], Coroutine[Any, Any, Any]]:
    """Deterministic mode (q8_0 KV: the per-row kernel for every batch): a
    prompt forked ``n`` ways, three lockstep rounds."""

    async def run(path: str) -> Any:
        async with await lloyal.create_context(
            path, n_ctx=1024, n_seq_max=n + 1, deterministic=True
        ) as ctx:
            root = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await root.prefill(await ctx.tokenize(PROMPT * 3))
            kids = [await root.fork() for _ in range(n)]
            return [[row(root.logits)]] + await lockstep(ctx, kids, 3)

    return run


async def one_sequence(path: str) -> Any:
    """Default mode (f16 KV): one prompt of ~600 tokens (the tiled kernel's
    causal rows) and three single-token decodes over more than 512 cells
    (the kernel that splits the cells among threads)."""
    async with await lloyal.create_context(path, n_ctx=2048) as ctx:
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(await ctx.tokenize(PROMPT * 40))
        out = [[row(b.logits)]]
        for step in range(3):
            await b.commit(token(0, step))
            out.append([row(b.logits)])
        return out


async def two_prompts(path: str) -> Any:
    """Default mode: two prompts of ~200 tokens, 32 forks of each, one round
    of 64 commits: dense rows in the tiled kernel, each prompt's KV tiles
    computed for its own 32 rows only."""
    async with await lloyal.create_context(path, n_ctx=2048, n_seq_max=66) as ctx:
        roots = [lloyal.Branch.create(ctx, lloyal.GREEDY) for _ in range(2)]
        for i, root in enumerate(roots):
            await root.prefill(await ctx.tokenize(f"Story {i}. " + PROMPT * 12))
        kids = [await root.fork() for root in roots for _ in range(32)]
        return [[row(r.logits) for r in roots]] + await lockstep(ctx, kids, 1)


async def many_prompts(path: str) -> Any:
    """Default mode: 64 distinct short prompts, three rounds of 64 commits:
    every row sees a few cells of each KV tile it touches (the per-row
    kernel with the patch, the tiled one without)."""
    async with await lloyal.create_context(path, n_ctx=2048, n_seq_max=64) as ctx:
        kids = [lloyal.Branch.create(ctx, lloyal.GREEDY) for _ in range(64)]
        prompts = [await ctx.tokenize(f"Question {i}: why is the sea blue?") for i in range(64)]
        await lloyal.BranchStore(ctx).prefill(list(zip(kids, prompts, strict=True)))
        return await lockstep(ctx, kids, 3)


SCENARIOS: dict[str, Callable[[str], Coroutine[Any, Any, Any]]] = {
    "forks_1": forks(1),
    "forks_8": forks(8),
    "forks_64": forks(64),
    "one_sequence": one_sequence,
    "two_prompts": two_prompts,
    "many_prompts": many_prompts,
}


async def many_prompts_by_8(path: str) -> Any:
    """``many_prompts`` with each round's commits in decodes of 8."""
    async with await lloyal.create_context(path, n_ctx=2048, n_seq_max=64) as ctx:
        kids = [lloyal.Branch.create(ctx, lloyal.GREEDY) for _ in range(64)]
        prompts = [await ctx.tokenize(f"Question {i}: why is the sea blue?") for i in range(64)]
        await lloyal.BranchStore(ctx).prefill(list(zip(kids, prompts, strict=True)))
        store = lloyal.BranchStore(ctx)
        out = []
        for step in range(3):
            for g in range(0, 64, 8):
                await store.commit([(kids[i], token(i, step)) for i in range(g, g + 8)])
            out.append([row(kid.logits) for kid in kids])
        return out


SCENARIOS["many_prompts_by_8"] = many_prompts_by_8


if __name__ == "__main__":
    model, scenario = sys.argv[1], sys.argv[2]
    print(json.dumps(asyncio.run(SCENARIOS[scenario](model))))
