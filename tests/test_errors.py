"""Bad input: a clear typed exception, the process survives, and the
context stays usable afterwards."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest

pytestmark = pytest.mark.anyio


async def still_works(ctx: lloyal.Context, seq: int = 0) -> None:
    pos = ctx.kv_seq_pos_max(seq) + 1
    tokens = await ctx.tokenize("still fine", add_special=pos == 0)
    await ctx.decode(tokens, pos, seq)
    assert np.isfinite(ctx.get_logits()).any()


async def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        await lloyal.create_context(tmp_path / "missing.gguf")


async def test_non_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"this is not a model" * 100)
    with pytest.raises(lloyal.ModelLoadError, match="not a GGUF"):
        await lloyal.create_context(bogus)


async def test_truncated_gguf(tmp_path: Path, smollm2: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2.read_bytes()[: 1 << 20])
    with pytest.raises(lloyal.ModelLoadError):
        await lloyal.create_context(truncated)


async def test_bad_options(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="n_seq_max"):
        await lloyal.create_context(smollm2, n_seq_max=257)
    with pytest.raises(ValueError, match="n_ctx"):
        await lloyal.create_context(smollm2, n_ctx=0)
    with pytest.raises(ValueError, match=r"n_ctx must be in \[8, 1073741824\]"):
        await lloyal.create_context(smollm2, n_ctx=2**32 - 1)
    with pytest.raises(ValueError, match="pooling"):
        await lloyal.create_context(smollm2, pooling="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="KV cache type"):
        await lloyal.create_context(smollm2, type_k="q3_k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_threads"):
        await lloyal.create_context(smollm2, n_threads=0)
    with pytest.raises(ValueError, match=r"n_threads must be in \[1, 512\]"):
        await lloyal.create_context(smollm2, n_threads=1000)


async def test_empty_input(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        with pytest.raises(ValueError, match="empty"):
            await ctx.decode([], 0)
        with pytest.raises(ValueError, match="no logits yet"):
            ctx.get_logits()
        with pytest.raises(ValueError, match="no logits yet"):
            ctx.sample()
        assert await ctx.tokenize("", add_special=False) == []
        await still_works(ctx)


async def test_token_id_out_of_range(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        await still_works(ctx)
        pos = ctx.kv_seq_pos_max(0) + 1
        for bad in (ctx.vocab_size, -1, 2**40):
            with pytest.raises(ValueError, match="out of range"):
                await ctx.decode([5, bad], pos)
            with pytest.raises(ValueError, match="out of range"):
                await ctx.detokenize([bad])
            with pytest.raises(ValueError, match="out of range"):
                ctx.token_to_text(bad)
            with pytest.raises(ValueError, match="out of range"):
                ctx.is_stop_token(bad)
            with pytest.raises(ValueError, match="out of range"):
                ctx.model_surprisal(bad)
        assert ctx.kv_seq_pos_max(0) == pos - 1  # nothing was decoded
        await still_works(ctx)


async def test_decoding_past_n_ctx(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_batch=64) as ctx:
        n = ctx.n_ctx
        tokens = (await ctx.tokenize("word " * (n + 100)))[: n + 40]
        with pytest.raises(lloyal.KVCacheFullError, match=f"n_ctx={n}"):
            await ctx.decode(tokens, 0)
        # The failed call left nothing behind: the sequence is still empty.
        assert ctx.kv_seq_pos_max(0) == -1
        await ctx.decode(tokens[: n - 4], 0)
        with pytest.raises(lloyal.KVCacheFullError):
            await ctx.decode(tokens[n - 4 : n + 6], n - 4)
        assert ctx.kv_seq_pos_max(0) == n - 5
        await ctx.decode(tokens[n - 4 : n - 2], n - 4)
        assert ctx.kv_seq_pos_max(0) == n - 3


async def test_n_ctx_reports_the_allocated_size(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=100) as ctx:
        # llama.cpp rounds the unified KV cache up to a multiple of 256.
        assert ctx.n_ctx == 256


async def test_bad_positions(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as ctx:
        tokens = await ctx.tokenize("Hello there")
        with pytest.raises(ValueError, match=">= 0"):
            await ctx.decode(tokens, -1)
        with pytest.raises(ValueError, match="next position is 0"):
            await ctx.decode(tokens, 5)
        await ctx.decode(tokens, 0)
        n = len(tokens)
        with pytest.raises(ValueError, match=f"next position is {n}"):
            await ctx.decode([tokens[0]], n + 3)  # a gap
        with pytest.raises(ValueError, match=f"next position is {n}"):
            await ctx.decode([tokens[0]], 0)  # overlapping
        with pytest.raises(ValueError, match="seq_id"):
            await ctx.decode([tokens[0]], 0, seq_id=2)
        with pytest.raises(ValueError, match="seq_id"):
            ctx.kv_seq_pos_max(-1)
        assert ctx.kv_seq_pos_max(0) == n - 1
        await still_works(ctx)
        await still_works(ctx, seq=1)


async def test_bad_sampling_input(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="top_p"):
        lloyal.SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match="top_k"):
        lloyal.SamplingParams(top_k=-1)
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        await still_works(ctx)
        with pytest.raises(ValueError, match="shape"):
            ctx.sample(logits=np.zeros(10, dtype=np.float32))
        with pytest.raises(ValueError, match="one-dimensional"):
            ctx.sample(logits=np.zeros((2, ctx.vocab_size), dtype=np.float32))
        with pytest.raises(ValueError, match="nothing can be sampled"):
            ctx.sample(logits=np.full(ctx.vocab_size, -np.inf, dtype=np.float32))
        with pytest.raises(ValueError, match="base"):
            ctx.model_entropy("decibels")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="temperature"):
            ctx.sample(lloyal.SamplingParams(temperature=float("nan")))
        await still_works(ctx)


async def test_wrong_types(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        with pytest.raises(TypeError):
            await ctx.tokenize(b"bytes")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="integers"):
            await ctx.decode(["a"], 0)  # type: ignore[list-item]
        await still_works(ctx)


async def test_n_batch_over_n_ctx_is_clamped_not_an_abort(model: Path) -> None:
    """llama.cpp clamps n_batch to n_ctx and aborts on a decode larger than
    that: lloyal splits at the clamped size and reports it."""
    text = "The river ran past the mill and under the bridge. " * 40
    async with await lloyal.create_context(model, n_ctx=300, n_seq_max=2) as ctx:
        assert ctx.n_batch == 300  # not the default 512
        tokens = (await ctx.tokenize(text))[:400]
        assert len(tokens) == 400
        await ctx.decode(tokens, 0)  # two llama_decode calls, 300 + 100
        assert ctx.kv_seq_pos_max(0) == 399
        await ctx.kv_cache_clear()  # 512 cells: room for one 400-token copy
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(tokens)  # the branch path splits the same way
        assert b.position == 400
        await b.prune()
    async with await lloyal.create_context(model, n_ctx=256, n_batch=10**9) as ctx:
        assert ctx.n_batch == 256
        too_long = (await ctx.tokenize(text))[:300]
        with pytest.raises(lloyal.KVCacheFullError):
            await ctx.decode(too_long, 0)
        await still_works(ctx)


async def test_embedding_n_batch_fits_n_ctx_and_n_seq_max(smollm2: Path) -> None:
    async with await lloyal.create_context(
        smollm2, embeddings=True, n_ctx=256, n_batch=256, n_seq_max=3
    ) as ctx:
        assert ctx.n_batch == 255  # a multiple of 3 that llama.cpp keeps
        vectors = await ctx.embed(["a cat", "a kitten", "tax law"])
        assert vectors.shape == (3, ctx.embedding_dim)
