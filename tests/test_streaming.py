"""Streaming past n_ctx: BlinkKV reseeding stays close to the full-context
baseline; naive eviction is measured next to it (bench/streaming.py prints
all three for both models)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal.models import model_path
from lloyal.streaming import stream_perplexity

from tests.conftest import ROUTE_NOISE, top1_margin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from streaming import three_ways


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_reseeding_stays_within_25_percent_of_baseline(name: str) -> None:
    r = asyncio.run(three_ways(name, n_ctx=256, times=4))
    assert r["tokens"] >= 4 * r["n_ctx"]
    assert r["reseed"] <= 1.25 * r["baseline"], r
    # Eviction is a different policy, not a broken one: it must at least run.
    assert r["evict"] > 1.0


def test_branch_clear_and_reseed_keeps_sampler_and_metrics() -> None:
    async def main() -> None:
        smollm2 = model_path("smollm2")
        async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=4) as ctx:
            tokens = await ctx.tokenize("A long story about a river. " * 30)
            b = lloyal.Branch.create(ctx, lloyal.SamplingParams(repeat_penalty=1.3, seed=1))
            await b.prefill(tokens[:8])
            for t in tokens[8:40]:
                await b.commit(t)
            ppl, params = b.perplexity, b.sampler_params
            child = await b.fork()
            await b.clear_and_reseed(tokens[:4], tokens[24:40])
            assert b.position == 20
            assert b.perplexity == ppl
            assert b.sampler_params == params
            assert child.position == 40  # children keep their own cells
            # The reseeded branch predicts what a fresh 20-token context does.
            # Its cells lie elsewhere, another route: each logit within
            # ROUTE_NOISE, the same argmax where the best two are
            # ROUTE_NOISE apart (tests/conftest.py).
            fresh = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await fresh.prefill(tokens[:4] + tokens[24:40])
            np.testing.assert_allclose(b.logits, fresh.logits, rtol=0, atol=ROUTE_NOISE)
            if top1_margin(fresh.logits) >= ROUTE_NOISE:
                assert b.logits.argmax() == fresh.logits.argmax()
            with pytest.raises(ValueError, match="both empty"):
                await b.clear_and_reseed([], [])
            with pytest.raises(ValueError, match="n_ctx"):
                await b.clear_and_reseed(tokens[:4], tokens * 2)
            assert b.position == 20  # refused input changed nothing
            await b.commit((await b.produce()).token)
            assert b.position == 21

    asyncio.run(main())


def test_stream_perplexity_rejects_bad_arguments() -> None:
    async def main() -> None:
        async with await lloyal.create_context(model_path("smollm2"), n_ctx=256) as ctx:
            with pytest.raises(ValueError, match="policy"):
                await stream_perplexity(ctx, [1, 2], policy="drop")  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="keep"):
                await stream_perplexity(ctx, [1, 2], keep=300)
            with pytest.raises(ValueError, match="two tokens"):
                await stream_perplexity(ctx, [1])

    asyncio.run(main())
