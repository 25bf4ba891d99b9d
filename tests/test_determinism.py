"""Batch invariance where llama.cpp's kernels give it (docs/determinism.md,
"Where the differences come from"): with a q8_0 KV cache, flash attention
runs its one-chunk kernel (f32 accumulation) whatever the batch, and
SmolLM2's Q4_1 weights take the dot-product path, which computes each
(weight row, token) pair the same way for any number of rows. So a branch
gets the same bits alone, in a batch of 8 at any row, and in one call or
split, and speculative decoding is exactly greedy. (Gemma 3's repacked
weights do not: see the doc.)"""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal import strategies

pytestmark = pytest.mark.anyio

PROMPT = "The quick brown fox jumps over the lazy dog. Then"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def eight_forks(path: Path, batched: bool) -> list[np.ndarray]:
    async with await lloyal.create_context(
        path, n_ctx=1024, n_seq_max=9, type_k="q8_0", type_v="q8_0"
    ) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kids = [await root.fork() for _ in range(8)]
        tokens = [100 + 37 * i for i in range(8)]
        if batched:
            await lloyal.BranchStore(ctx).commit(list(zip(kids, tokens, strict=True)))
        else:
            for kid, token in zip(kids, tokens, strict=True):
                await kid.commit(token)
        return [kid.logits.copy() for kid in kids]


async def test_a_branch_gets_the_same_bits_alone_or_in_a_batch(smollm2: Path) -> None:
    alone = await eight_forks(smollm2, batched=False)
    batched = await eight_forks(smollm2, batched=True)
    for row, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert np.array_equal(a, b), f"row {row}: max |diff| {np.max(np.abs(a - b))}"


async def test_one_call_or_split_gives_the_same_bits(smollm2: Path) -> None:
    async def prefill(step: int) -> np.ndarray:
        async with await lloyal.create_context(
            smollm2, n_ctx=1024, type_k="q8_0", type_v="q8_0"
        ) as ctx:
            tokens = await ctx.tokenize("The quick brown fox jumps over the lazy dog. " * 8)
            b = lloyal.Branch.create(ctx, lloyal.GREEDY)
            for i in range(0, len(tokens), step):
                await b.prefill(tokens[i : i + step])
            return b.logits.copy()

    one_call = await prefill(10_000)
    for step in (1, 7, 64):
        assert np.array_equal(one_call, await prefill(step)), step


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


async def test_speculation_is_exactly_greedy_where_logits_are_invariant(smollm2: Path) -> None:
    """With batch-invariant logits, speculative decoding at temperature 0 is
    the target's greedy output token for token (whatever the margins), and
    a model drafting for itself accepts every draft."""
    async with (
        await lloyal.create_context(
            smollm2, n_ctx=2048, n_seq_max=2, type_k="q8_0", type_v="q8_0"
        ) as target,
        await lloyal.create_context(smollm2, n_ctx=2048, type_k="q8_0", type_v="q8_0") as draft,
    ):
        for prompt in PROMPTS:
            chat = target.format_chat([{"role": "user", "content": prompt}])
            stop = chat.stop_tokens
            plain = await strategies.generate(target, chat.prompt, max_tokens=16, stop=stop)
            drafted = await strategies.speculative_decode(
                target, chat.prompt, draft=draft, k=4, max_tokens=16, stop=stop
            )
            lookup = await strategies.speculative_decode(
                target, chat.prompt, k=4, max_tokens=16, stop=stop
            )
            assert drafted.tokens == plain.tokens, prompt
            assert lookup.tokens == plain.tokens, prompt
            assert drafted.acceptance_rate == 1.0, prompt
