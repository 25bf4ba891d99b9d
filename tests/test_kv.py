"""KV cache operations and persistence: save/load bytes and files, remove,
copy/keep, clear, BlinkKV reseeding."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest

from tests.conftest import ROUTE_NOISE

pytestmark = pytest.mark.anyio

PROMPT = "The museum guard noticed that the painting had"


async def greedy(ctx: lloyal.Context, pos: int, n: int, seq: int = 0) -> list[int]:
    out = []
    for _ in range(n):
        out.append(ctx.greedy_sample())
        await ctx.decode([out[-1]], pos, seq)
        pos += 1
    return out


async def test_save_load_into_a_fresh_context_continues_identically(
    model: Path, tmp_path: Path
) -> None:
    async with await lloyal.create_context(model, n_ctx=512) as ctx:
        tokens = await ctx.tokenize(PROMPT)
        await ctx.decode(tokens[:-1], 0)
        state = await ctx.kv_cache_save(0, tokens[:-1])
        written = await ctx.kv_cache_write_file(0, tmp_path / "seq.kv", tokens[:-1])
        assert written == len(state)
        await ctx.decode(tokens[-1:], len(tokens) - 1)
        expected = await greedy(ctx, len(tokens), 8)
    for how in ("bytes", "file"):
        async with await lloyal.create_context(model, n_ctx=512) as fresh:
            if how == "bytes":
                held = await fresh.kv_cache_load(0, state)
            else:
                held = await fresh.kv_cache_read_file(0, tmp_path / "seq.kv")
            assert held == tokens[:-1]
            assert fresh.kv_cache_size(0) == len(tokens) - 1
            # Same route: the saved cells hold the same bits in the same
            # places, and the rest is decoded as before, so the same tokens.
            await fresh.decode(tokens[-1:], len(tokens) - 1)
            assert await greedy(fresh, len(tokens), 8) == expected


async def test_bad_states_raise_state_error_and_leave_the_context_usable(
    smollm2: Path, gemma3: Path, tmp_path: Path
) -> None:
    async with await lloyal.create_context(gemma3, n_ctx=256) as other:
        foreign = await other.kv_cache_save(0, [])
        tokens = await other.tokenize("hello")
        await other.decode(tokens, 0)
        foreign = await other.kv_cache_save(0, tokens)
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
        tokens = await ctx.tokenize(PROMPT)
        await ctx.decode(tokens, 0)
        good = await ctx.kv_cache_save(0, tokens)
        flipped = bytearray(good)
        flipped[len(flipped) // 2] ^= 0xFF
        (tmp_path / "foreign.kv").write_bytes(foreign)
        for bad, match in [
            (good[: len(good) // 2], "corrupt or truncated"),
            (bytes(flipped), "corrupt or truncated"),
            (b"not a state at all" * 10, "not a lloyal KV state"),
            (foreign, "different model"),
        ]:
            with pytest.raises(lloyal.StateError, match=match):
                await ctx.kv_cache_load(1, bad)
            assert ctx.kv_cache_size(1) == 0
        with pytest.raises(lloyal.StateError, match="different model"):
            await ctx.kv_cache_read_file(1, tmp_path / "foreign.kv")
        with pytest.raises(FileNotFoundError):
            await ctx.kv_cache_read_file(1, tmp_path / "missing.kv")
        # Untouched and usable.
        assert ctx.kv_cache_size(0) == len(tokens)
        await ctx.kv_cache_load(1, good)
        await ctx.decode([ctx.eog_token], len(tokens), 1)


async def test_remove_copy_keep_clear(smollm2: Path) -> None:
    # CUDA's kernels depend on the batch shape (docs/gpu.md): keep to the CPU.
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=3, n_gpu_layers=0) as ctx:
        tokens = await ctx.tokenize(PROMPT)
        n = len(tokens)
        await ctx.decode(tokens, 0)
        logits_full = ctx.get_logits().copy()
        # Rewrite the last token: remove it and decode it again. Alone, not
        # at the end of the prompt's batch: another route, so each logit
        # within ROUTE_NOISE (tests/conftest.py). A wrong cache would
        # give another distribution.
        await ctx.kv_cache_remove(0, n - 1)
        assert ctx.kv_cache_size(0) == n - 1
        await ctx.decode(tokens[-1:], n - 1)
        np.testing.assert_allclose(ctx.get_logits(), logits_full, rtol=0, atol=ROUTE_NOISE)
        # Copy shares cells; both sequences continue alike (the second token
        # goes into another cell: another route, the same tolerance).
        ctx.kv_seq_copy(0, 1)
        assert ctx.kv_seq_pos_max(1) in (-1, n - 1)  # queued: visible after the next call
        await ctx.decode([tokens[0]], n, 0)
        a = ctx.get_logits().copy()
        await ctx.decode([tokens[0]], n, 1)
        np.testing.assert_allclose(ctx.get_logits(), a, rtol=0, atol=ROUTE_NOISE)
        ctx.kv_seq_keep(1)
        await ctx.decode([tokens[1]], n + 1, 1)
        assert ctx.kv_cache_size(0) == 0
        assert ctx.kv_cache_size(1) == n + 2
        with pytest.raises(ValueError, match="bad range"):
            await ctx.kv_cache_remove(1, 5, 2)
        await ctx.kv_cache_clear()
        assert ctx.kv_cache_size(1) == 0
        await ctx.decode(tokens, 0, 2)


async def test_flat_kv_ops_refuse_branch_sequences(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
        branch = lloyal.Branch.create(ctx)
        await branch.prefill(await ctx.tokenize("hi"))
        leased = next(s for s in range(2) if ctx.kv_cache_size(s) > 0)
        with pytest.raises(ValueError, match="leased by a branch"):
            await ctx.decode([1], 5, leased)
        with pytest.raises(ValueError, match="leased by a branch"):
            await ctx.kv_cache_remove(leased, 0)
        with pytest.raises(ValueError, match="prune them first"):
            await ctx.kv_cache_clear()
        assert branch.position == ctx.kv_cache_size(leased)


async def test_clear_and_reseed_keeps_generating(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        doc = (await ctx.tokenize("The river flows to the sea. " * 60))[:250]
        await ctx.decode(doc, 0)
        sinks, tail = doc[:4], doc[-100:]
        await ctx.clear_and_reseed(sinks, tail)
        assert ctx.kv_cache_size(0) == 104
        # The context continues sensibly from the tail: the repeated text is
        # predicted confidently.
        nxt = ctx.greedy_sample()
        assert ctx.model_surprisal(nxt) < 2.0
        await ctx.decode([nxt], 104)
        with pytest.raises(ValueError, match="both empty"):
            await ctx.clear_and_reseed([], [])


async def test_branch_snapshot_restores_as_a_new_branch(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        snapshot = await root.save()
        expected = []
        for _ in range(5):
            t = (await root.produce()).token
            await root.commit(t)
            expected.append(t)
        await root.prune()
        # Same route: the restored cells and logits are the saved bits in
        # the cells the root had (it is pruned), so the same tokens.
        restored = await lloyal.Branch.restore(ctx, snapshot, params=lloyal.GREEDY)
        assert restored.parent is None
        got = []
        for _ in range(5):
            t = (await restored.produce()).token
            await restored.commit(t)
            got.append(t)
        assert got == expected
        with pytest.raises(lloyal.StateError):
            await lloyal.Branch.restore(ctx, snapshot[:-10])
        assert lloyal.BranchStore(ctx).available == 2
