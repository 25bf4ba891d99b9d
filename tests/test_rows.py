"""Per-position logits: ``prefill(tokens, logits="all")`` returns every
position's distribution from the same decode (issue 15, item 4)."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest

from tests.conftest import COUNTING, ROUTE_NOISE

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_every_row_is_that_positions_distribution(model: Path, model_name: str) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=3) as ctx:
        tokens = await ctx.tokenize(COUNTING[model_name])
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        rows = await b.prefill(tokens, logits="all")
        assert rows.shape == (len(tokens), ctx.vocab_size)
        assert rows.dtype == np.float32
        assert not rows.flags.writeable
        assert b.position == len(tokens)
        # The last row is the branch's snapshot: the same decode, same bits.
        assert np.array_equal(rows[-1], b.logits)
        # Row i against a separate prefill of tokens[: i + 1] (another route:
        # ROUTE_NOISE apart at most; another row would be far off).
        for i in (0, len(tokens) // 2, len(tokens) - 2):
            other = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await other.prefill(tokens[: i + 1])
            assert np.max(np.abs(rows[i] - other.logits)) < ROUTE_NOISE
            await other.prune()
        # Row i predicts token i + 1: late in a count the model knows what
        # comes next (numbers and separators alternate, so rows one off
        # would miss nearly every time).
        hits = rows[:-1].argmax(axis=1) == np.asarray(tokens[1:])
        assert hits[-8:].sum() >= 5, hits
        # Decoding continues from the snapshot as after a plain prefill.
        await b.commit((await b.produce()).token)
        assert b.position == len(tokens) + 1
        await b.prune()


async def test_rows_are_gathered_across_split_decodes(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_batch=16, n_seq_max=2) as ctx:
        tokens = (await ctx.tokenize("The river ran past the mill and under the bridge. " * 4))[:40]
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        before = ctx.stats.decode_calls
        rows = await b.prefill(tokens, logits="all")
        assert ctx.stats.decode_calls - before == 3  # 16 + 16 + 8
        assert rows.shape == (40, ctx.vocab_size)
        assert np.array_equal(rows[-1], b.logits)
        assert np.isfinite(rows).all()
        await b.prune()


async def test_store_prefill_returns_each_items_rows(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("Once upon a time"))
        a, b = await root.fork(), await root.fork()
        store = lloyal.BranchStore(ctx)
        drafts = [await ctx.tokenize(t, add_special=False) for t in (" there was", " a cat")]
        before = ctx.stats.decode_calls
        rows = await store.prefill([(a, drafts[0]), (b, drafts[1])], logits="all")
        assert ctx.stats.decode_calls - before == 1
        assert [r.shape[0] for r in rows] == [len(d) for d in drafts]
        assert np.array_equal(rows[0][-1], a.logits)
        assert np.array_equal(rows[1][-1], b.logits)
        # A plain prefill afterwards returns nothing and keeps no rows.
        assert await store.prefill([(a, [drafts[0][0]])]) is None
        await root.prune_subtree()


async def test_bad_logits_mode(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        with pytest.raises(ValueError, match='"last" or "all"'):
            await b.prefill([1, 2], logits="some")  # type: ignore[call-overload]
        assert b.position == 0
        await b.prune()


async def test_truncate_drops_a_rejected_draft(model: Path, model_name: str) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=3) as ctx:
        prompt = await ctx.tokenize(COUNTING[model_name])
        draft = await ctx.tokenize(" banana banana", add_special=False)
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        rows = await b.prefill(prompt + draft, logits="all")
        await b.truncate(len(prompt), logits=rows[len(prompt) - 1])
        assert b.position == len(prompt)
        reference = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await reference.prefill(prompt)
        # Both continue the count the same way, and the next decode lands at
        # the truncated position (it would be refused anywhere else).
        for _ in range(3):
            mine, theirs = await b.produce(), await reference.produce()
            assert mine.token == theirs.token  # COUNTING's margins >> ROUTE_NOISE
            await lloyal.BranchStore(ctx).commit([(b, mine.token), (reference, theirs.token)])
            assert np.max(np.abs(b.logits - reference.logits)) < ROUTE_NOISE
        assert b.position == len(prompt) + 3
        # Without logits the snapshot is cleared: produce needs a decode.
        await b.truncate(len(prompt))
        with pytest.raises(ValueError, match="logits"):
            await b.produce()
        for bad in (-1, len(prompt) + 1):
            with pytest.raises(ValueError, match="position must be in"):
                await b.truncate(bad)
        with pytest.raises(ValueError, match="logits"):
            await b.truncate(0, logits=np.zeros(3, dtype=np.float32))
        assert b.position == len(prompt)
        await b.prune()
        await reference.prune()
