"""BranchStore.prefill_tree: a token tree in one decode, shared prefixes
decoded once, one branch per leaf; and tree speculation built on it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import lloyal
import numpy as np
import pytest
from lloyal import strategies

from tests._hang import HANG_GUARD_S
from tests.conftest import ROUTE_NOISE

pytestmark = pytest.mark.anyio

PROMPT = "The quick brown fox jumps over the lazy dog. Then"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_tree_is_one_decode_with_a_branch_per_leaf(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        base = root.position
        store = lloyal.BranchStore(ctx)
        # 0 -> 1 -> 2, 0 -> 3, and 4 on its own
        tokens, parents = [100, 200, 300, 400, 500], [-1, 0, 1, 0, -1]
        calls, decoded = ctx.stats.decode_calls, ctx.stats.tokens_decoded
        tree = await store.prefill_tree(root, tokens, parents)
        assert ctx.stats.decode_calls - calls == 1
        assert ctx.stats.tokens_decoded - decoded == len(tokens)  # shared once
        assert tree.rows.shape == (5, ctx.vocab_size)
        assert not tree.rows.flags.writeable
        assert tree.leaves == (2, 3, 4)
        assert tree.branches[0] is root
        assert [b.position - base for b in tree.branches] == [3, 2, 1]
        assert tree.path(2) == [0, 1, 2]
        assert tree.branch_of(1) is root
        assert tree.branch_of(3) is tree.branches[1]
        for leaf, b in zip(tree.leaves, tree.branches, strict=True):
            np.testing.assert_array_equal(b.logits, tree.rows[leaf])
            assert b.parent is None
        assert store.available == 1
        # Each path's rows match decoding that path on a branch of its own
        # (another layout: the likely tokens within the route noise; the
        # deterministic mode's bit-identity is test_determinism.py's).
        for leaf in tree.leaves:
            alone = await root.fork()
            await alone.truncate(base)
            rows = await alone.prefill([tokens[j] for j in tree.path(leaf)], logits="all")
            for mine, theirs in zip(tree.rows[tree.path(leaf)], rows, strict=True):
                likely = np.argsort(-mine)[:10]
                np.testing.assert_allclose(mine[likely], theirs[likely], atol=ROUTE_NOISE)
            await alone.prune()
        # Any order: every leaf branch is a root.
        for b in tree.branches:
            await b.prune()
        assert store.available == 4


async def test_a_cancelled_tree_gives_the_leaves_it_never_returned_back(smollm2: Path) -> None:
    """The decode runs to its end (the root carries the first leaf); the
    other leaves arrive as seeds nobody takes, and their leases return."""
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        base = root.position
        store = lloyal.BranchStore(ctx)
        task = asyncio.ensure_future(store.prefill_tree(root, [100, 200, 300], [-1, -1, -1]))
        await asyncio.sleep(0)  # submitted
        assert root._busy
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Hang guard only: the worker answers within milliseconds.
        with anyio.fail_after(HANG_GUARD_S):
            while root._busy or store.available != 3:  # noqa: ASYNC110 - polling the worker
                await asyncio.sleep(0)
        assert root.position == base + 1
        assert root.children == []
        await root.prune()
        assert store.available == 4


async def test_a_bad_tree_changes_nothing(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=2) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        before, logits = root.position, root.logits.copy()
        store = lloyal.BranchStore(ctx)
        for tokens, parents, error in [
            ([], [], ValueError),
            ([1, 2], [-1], ValueError),
            ([1, 2], [-1, 1], ValueError),  # a node its own parent
            ([1, 2], [-1, -2], ValueError),
            ([1, ctx.vocab_size], [-1, 0], ValueError),
            ([1, 2], [-1, "0"], TypeError),
            ([1, 2, 3], [-1, -1, -1], lloyal.NoLeaseError),  # 3 leaves, 2 leases
        ]:
            with pytest.raises(error):
                await store.prefill_tree(root, tokens, parents)  # type: ignore[arg-type]
            assert root.position == before
            np.testing.assert_array_equal(root.logits, logits)
            assert store.available == 1
        # Still fine afterwards.
        tree = await store.prefill_tree(root, [5, 6], [-1, -1])
        assert [b.position for b in tree.branches] == [before + 1] * 2


async def test_tree_speculation_with_second_choice_drafts(smollm2: Path) -> None:
    """The draft proposes its second choice, with its first as the sibling:
    the target takes the sibling's path every round, and the output is
    plain greedy decoding's (same margins on every route here: drafts from
    the same model, a counting prompt)."""
    async with (
        await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4) as target,
        await lloyal.create_context(smollm2, n_ctx=1024) as draft,
    ):
        prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
        plain = await strategies.generate(target, prompt, max_tokens=12)
        tree = await strategies.speculative_decode(
            target, prompt, draft=draft, k=3, max_tokens=12, width=3, confidence=1.0
        )
        assert tree.tokens == plain.tokens
        assert tree.acceptance_rate == 1.0
        assert tree.verified > tree.rounds * 4  # siblings were verified too
        assert lloyal.BranchStore(target).available == 4


async def test_tree_speculation_needs_a_draft_model_at_temperature_0(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_seq_max=2) as ctx:
        with pytest.raises(ValueError, match="draft model and temperature 0"):
            await strategies.speculative_decode(ctx, "Hi", width=2)
        with pytest.raises(ValueError, match="width must be >= 1"):
            await strategies.speculative_decode(ctx, "Hi", width=0)
        with pytest.raises(ValueError, match="confidence"):
            await strategies.speculative_decode(ctx, "Hi", confidence=1.5)


async def test_a_tree_that_does_not_fit_changes_nothing(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill([100 + i % 50 for i in range(ctx.n_ctx - 20)])
        before, logits = root.position, root.logits.copy()
        store = lloyal.BranchStore(ctx)
        chain = list(range(-1, 29))  # 30 nodes in a chain, then a sibling leaf
        with pytest.raises(lloyal.KVCacheFullError):
            await store.prefill_tree(root, [7] * 31, [*chain, 0])
        assert root.position == before
        np.testing.assert_array_equal(root.logits, logits)
        assert store.available == 2
        await root.commit(5)
        assert root.position == before + 1
