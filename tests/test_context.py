"""Context lifecycle, attributes and options, on both test models."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal import _lloyal

from tests.conftest import open_sync

pytestmark = pytest.mark.anyio


async def test_load_and_model_info(model: Path, model_name: str) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=2) as ctx:
        info = ctx.model_info
        assert info.path == model
        assert info.architecture == {"smollm2": "llama", "gemma3": "gemma3"}[model_name]
        assert info.vocab_size == ctx.vocab_size > 1000
        assert info.n_params > 100_000_000
        assert info.has_chat_template == (model_name == "smollm2")
        assert ctx.n_ctx == 512
        assert ctx.n_seq_max == 2
        assert ctx.n_batch == 512
        assert ctx.embedding_dim == info.n_embd > 0
        assert ctx.n_threads >= 1
        assert ctx.memory_size > info.size_bytes
        assert ctx.metadata("general.architecture") == info.architecture
        assert ctx.metadata("no.such.key") is None
        assert "open" in repr(ctx)


async def test_memory_size_grows_with_n_ctx_and_shrinks_with_quantised_kv(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as small:
        small_size = small.memory_size
    async with await lloyal.create_context(smollm2, n_ctx=1024) as big:
        assert big.memory_size > small_size
        big_size = big.memory_size
    async with await lloyal.create_context(
        smollm2, n_ctx=1024, type_k="q8_0", type_v="q8_0"
    ) as quantised:
        assert small_size < quantised.memory_size < big_size


async def test_f32_kv_is_twice_the_cache_with_the_logits_of_f16(smollm2: Path) -> None:
    # llama.cpp's flash attention (on for the CPU) casts f32 K/V to f16.
    logits, sizes = {}, {}
    for kv in ("f16", "f32", "q8_0"):
        async with await lloyal.create_context(smollm2, n_ctx=512, type_k=kv, type_v=kv) as ctx:
            tokens = await ctx.tokenize("The printing press changed how books were made")
            await ctx.decode(tokens, 0)
            logits[kv], sizes[kv] = ctx.get_logits().copy(), ctx.memory_size
    # Only the cache differs: 4, 2 and 34/32 bytes an element.
    elements = (sizes["f32"] - sizes["f16"]) / 2
    assert elements > 0
    assert sizes["f16"] - sizes["q8_0"] == elements * (2 - 34 / 32)
    np.testing.assert_array_equal(logits["f32"], logits["f16"])
    assert not np.array_equal(logits["q8_0"], logits["f16"])


async def test_every_option_is_accepted(smollm2: Path) -> None:
    async with await lloyal.create_context(
        smollm2,
        n_ctx=256,
        n_batch=64,
        n_seq_max=4,
        n_threads=1,
        embeddings=False,
        pooling="last",
        type_k="q8_0",
        type_v="f16",
        n_gpu_layers=0,
    ) as ctx:
        assert ctx.n_threads == 1
        tokens = await ctx.tokenize("Option check")
        await ctx.decode(tokens, 0, seq_id=3)
        assert ctx.kv_seq_pos_max(3) == len(tokens) - 1


async def test_stats_count_decodes(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_batch=8) as ctx:
        assert ctx.stats.decode_calls == 0
        tokens = await ctx.tokenize("one two three four five six seven eight nine ten")
        await ctx.decode(tokens, 0)
        stats = ctx.stats
        # Split into n_batch-sized llama_decode calls.
        assert stats.decode_calls == -(-len(tokens) // 8)
        assert stats.tokens_decoded == len(tokens)
        assert stats.decode_seconds > 0


async def test_aclose_is_idempotent_and_later_calls_raise(smollm2: Path) -> None:
    ctx = await lloyal.create_context(smollm2, n_ctx=256)
    await ctx.aclose()
    await ctx.aclose()
    ctx.close()
    assert ctx.closed
    with pytest.raises(lloyal.ContextClosedError):
        await ctx.decode([1], 0)
    with pytest.raises(lloyal.ContextClosedError):
        await ctx.tokenize("x")
    with pytest.raises(lloyal.ContextClosedError):
        ctx.get_logits()
    with pytest.raises(lloyal.ContextClosedError):
        ctx.sample()
    with pytest.raises(lloyal.ContextClosedError):
        ctx.kv_seq_pos_max(0)
    with pytest.raises(lloyal.ContextClosedError):
        ctx.format_chat([{"role": "user", "content": "x"}])
    assert "closed" in repr(ctx)


async def test_close_fails_queued_operations(smollm2: Path) -> None:
    """Operations queued behind a close fail with ContextClosedError; none hang."""
    import anyio

    ctx = await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=8)
    prompt = await ctx.tokenize("A long prompt to keep the worker busy. " * 30)
    outcomes: list[object] = []

    async def decode(seq: int) -> None:
        try:
            await ctx.decode(prompt, 0, seq_id=seq)
            outcomes.append("ok")
        except lloyal.ContextClosedError as e:
            outcomes.append(e)

    async with anyio.create_task_group() as tg:
        for seq in range(4):
            tg.start_soon(decode, seq)
        await anyio.sleep(0.01)
        await ctx.aclose()
    assert len(outcomes) == 4
    assert any(isinstance(o, lloyal.ContextClosedError) for o in outcomes)


async def test_contexts_are_independent(smollm2: Path, gemma3: Path) -> None:
    async with (
        await lloyal.create_context(smollm2, n_ctx=256) as a,
        await lloyal.create_context(gemma3, n_ctx=256) as b,
    ):
        ta = await a.tokenize("Hello")
        tb = await b.tokenize("Hello")
        await a.decode(ta, 0)
        await b.decode(tb, 0)
        assert a.get_logits().shape == (a.vocab_size,)
        assert b.get_logits().shape == (b.vocab_size,)
        await a.aclose()
        # Closing one leaves the other usable.
        await b.decode([b.greedy_sample()], len(tb))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files in /proc")
def test_an_event_loop_that_is_gone_leaves_no_pipe_behind(smollm2: Path) -> None:
    """Each asyncio loop that awaits native work gets a pipe that wakes it
    with results; the pipe is closed once the loop is collected."""
    ctx = open_sync(smollm2, n_ctx=256)

    async def use() -> None:
        await ctx.kv_cache_clear()

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    try:
        asyncio.run(use())
        gc.collect()
        before = open_fds()
        for _ in range(5):
            asyncio.run(use())
        gc.collect()
        assert open_fds() == before
    finally:
        ctx.close()
    with pytest.raises(ValueError, match="two distinct ends"):
        _lloyal.ResultQueue(7, 7)
