"""Embeddings: batched equals one at a time, similarity, pooling modes."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest

pytestmark = pytest.mark.anyio

TEXTS = [
    "The cat sat on the mat.",
    "A kitten was sitting on the rug.",
    "Quarterly tax filings are due in April.",
    "Interest rates rose again this year.",
]


# How close embeddings of the same text by two routes (batch layouts) must
# point: the same direction, not the same bits. The CPU kernels round
# differently by batch layout, by an amount that varies with the host CPU
# (docs/determinism.md; Gemma 3 on AVX-512: 3.4e-3 apart, cosine > 0.9999).
# CUDA's kernels also depend on the batch shape, and llama.cpp sends large
# batches to the GPU even with n_gpu_layers=0 (docs/gpu.md; H100: cosine
# >= 0.994).
MIN_COSINE = 0.99 if lloyal.supports_gpu_offload() else 0.999


def assert_same_direction(a: np.ndarray, b: np.ndarray) -> None:
    """Rows of unit vectors ``a`` and ``b`` point the same way."""
    cosine = (a * b).sum(axis=-1)
    assert (cosine >= MIN_COSINE).all(), cosine


async def test_batched_equals_one_at_a_time(model: Path) -> None:
    async with await lloyal.create_context(model, embeddings=True, n_seq_max=8) as ctx:
        before = ctx.stats.decode_calls
        batched = await ctx.embed(TEXTS)
        assert ctx.stats.decode_calls - before == 1  # four texts, one decode
        assert batched.shape == (len(TEXTS), ctx.embedding_dim)
        assert batched.dtype == np.float32
        # Same route (the same batch into the same empty cache): the same bits.
        np.testing.assert_array_equal(await ctx.embed(TEXTS), batched)
        singles = np.stack([await ctx.embed(t) for t in TEXTS])
        # Another route (one text per decode): the same direction.
        assert_same_direction(batched, singles)


async def test_similar_sentences_score_closer(model: Path) -> None:
    async with await lloyal.create_context(model, embeddings=True, n_seq_max=4) as ctx:
        v = await ctx.embed(TEXTS)
        sim = v @ v.T
        assert sim[0, 1] > sim[0, 2]
        assert sim[0, 1] > sim[0, 3]
        assert sim[2, 3] > sim[2, 0]


async def test_normalization(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, embeddings=True) as ctx:
        unit = await ctx.embed(TEXTS[:2])
        np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-5)
        raw = await ctx.embed(TEXTS[:2], normalize=False)
        assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
        # Same route, so the same raw bits; only the division rounds differently.
        np.testing.assert_allclose(
            raw / np.linalg.norm(raw, axis=1, keepdims=True), unit, atol=1e-5
        )
        assert ctx.has_pooling
        await ctx.encode(await ctx.tokenize(TEXTS[0]))
        one = ctx.get_embeddings()
        assert one.shape == (ctx.embedding_dim,)
        # One text alone vs two in a batch: another route, the same direction.
        assert_same_direction(one / np.linalg.norm(one), unit[0])


@pytest.mark.parametrize("pooling", ["cls", "last"])
async def test_other_poolings(smollm2: Path, pooling: str) -> None:
    async with await lloyal.create_context(smollm2, embeddings=True, pooling=pooling) as ctx:  # type: ignore[arg-type]
        v = await ctx.embed(TEXTS)
        assert v.shape == (len(TEXTS), ctx.embedding_dim)
        assert np.isfinite(v).all()


async def test_pooling_none_gives_token_rows(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, embeddings=True, pooling="none") as ctx:
        assert not ctx.has_pooling
        tokens = await ctx.tokenize(TEXTS[0])
        await ctx.encode(tokens)
        rows = ctx.get_embeddings()
        assert rows.shape == (len(tokens), ctx.embedding_dim)
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)
        with pytest.raises(ValueError, match="pooled"):
            await ctx.embed("x")


async def test_misuse_raises_and_leaves_context_usable(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_batch=32, n_seq_max=3) as ctx:
        with pytest.raises(ValueError, match="embeddings=True"):
            await ctx.embed("not an embedding context")
    async with await lloyal.create_context(
        smollm2, embeddings=True, n_batch=32, n_seq_max=3, n_gpu_layers=0
    ) as ctx:
        with pytest.raises(ValueError, match="no embeddings yet"):
            ctx.get_embeddings()
        with pytest.raises(ValueError, match="n_batch"):
            await ctx.embed("word " * 100)
        with pytest.raises(ValueError, match="empty"):
            await ctx.encode([])
        with pytest.raises(TypeError):
            await ctx.embed([1, 2])  # type: ignore[list-item]
        store = lloyal.BranchStore(ctx)
        available = store.available
        # More texts than sequences: several decodes, the same answers up to
        # route (each copy of a text sits elsewhere in another batch).
        v = await ctx.embed(TEXTS + TEXTS)
        assert_same_direction(v[:4], v[4:])
        assert store.available == available  # borrowed sequences came back
        assert ctx.kv_cache_size() == 0
