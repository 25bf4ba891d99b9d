"""Rerankers: ``pooling="rank"`` on a model with a classification head
scores query-document pairs (``Context.ranks``, ``Rerank(method="rank")``,
the server's ``/v1/rerank``). The test reranker is
``fixtures.reranker()``: SmolLM2 converted the way llama.cpp converts
Qwen3-Reranker (a two-row head, "yes" and "no", softmaxed)."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal import fixtures
from lloyal.server import ServerConfig

from tests._asgi import in_process

pytestmark = pytest.mark.anyio

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital is Paris."]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def reranker() -> Path:
    return fixtures.reranker()


@pytest.mark.deterministic_first
async def test_a_rank_context_scores_pairs(reranker: Path) -> None:
    # Deterministic: a pair scores the same alone as in a batch (without
    # it, a few percent apart on a CPU: docs/determinism.md).
    async with await lloyal.create_context(
        reranker, embeddings=True, pooling="rank", n_seq_max=4, deterministic=True
    ) as ctx:
        assert ctx.ranks
        assert ctx.is_reranker
        assert not ctx.has_pooling
        assert ctx.embedding_dim == 2
        rerank = lloyal.Rerank(ctx)
        assert rerank.method == "rank"
        scores = await rerank.score(QUERY, DOCS)
        assert scores.shape == (3,)
        assert scores.dtype == np.float32
        # The head's two outputs are softmaxed: P(yes) is in (0, 1).
        assert ((scores > 0) & (scores < 1)).all()
        pair = await rerank.pair(QUERY, DOCS[0])
        text = await ctx.detokenize(pair, render_special=True)
        assert "<Query>: What is the capital" in text
        assert "<Document>: Paris is" in text
        rows = await ctx.embed_tokens([pair])  # scores: never normalized
        assert rows.shape == (1, 2)
        assert rows[0].sum() == pytest.approx(1.0, abs=1e-3)
        assert rows[0, 0] == scores[0]
        with pytest.raises(ValueError, match="rank method"):
            lloyal.Rerank(ctx, method="embedding")


async def test_rank_needs_a_reranker(model: Path) -> None:
    async with await lloyal.create_context(model, n_seq_max=2) as ctx:
        assert not ctx.is_reranker
        with pytest.raises(ValueError, match="rank method"):
            lloyal.Rerank(ctx, method="rank")
    async with await lloyal.create_context(model, embeddings=True, pooling="rank") as ctx:
        with pytest.raises(ValueError, match="classification head"):
            await ctx.embed("hello")


@pytest.mark.deterministic_first
async def test_the_server_reranks_with_a_rerankers_scores(reranker: Path) -> None:
    config = ServerConfig(model_path=reranker, n_ctx=1024, n_seq_max=2, deterministic=True)
    async with in_process(config) as (c, _):
        body = {"query": QUERY, "documents": DOCS, "return_documents": True}
        r = (await c.post("/v1/rerank", json=body)).json()
        scores = [x["relevance_score"] for x in r["results"]]
        assert scores == sorted(scores, reverse=True)
        assert all(0 < s < 1 for s in scores)
        assert sorted(x["index"] for x in r["results"]) == [0, 1, 2]
        async with await lloyal.create_context(
            reranker, embeddings=True, pooling="rank", n_seq_max=4, deterministic=True
        ) as ctx:
            mine = await lloyal.Rerank(ctx).score(QUERY, DOCS)
        for x in r["results"]:
            assert x["relevance_score"] == float(mine[x["index"]])
        e = await c.post("/v1/embeddings", json={"input": "hi"})
        assert e.status_code == 404
        assert "reranker" in e.json()["error"]["message"]
