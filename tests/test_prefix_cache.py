"""PrefixCache, Rerank, merge_logits, fork(clone_logits/root), kv_pressure.

Async tests run on asyncio; they are about reuse and counts, not loops.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal.models import model_path

from tests._hang import HANG_GUARD_S
from tests.conftest import MODELS, ROUTE_NOISE

SHARED = "You are a careful assistant. Answer briefly and precisely. " * 48


@pytest.mark.asyncio
@pytest.mark.parametrize("model_name", MODELS)
async def test_second_request_prefills_only_its_suffix(model_name: str) -> None:
    async with await lloyal.create_context(model_path(model_name), n_ctx=2048, n_seq_max=6) as ctx:
        cache = lloyal.PrefixCache(ctx, max_branches=4, params=lloyal.GREEDY)
        prefix = await ctx.tokenize(SHARED)
        assert len(prefix) >= 500
        q1 = await ctx.tokenize(" Question one: what is two plus two?", add_special=False)
        q2 = await ctx.tokenize(" Question two: name a colour.", add_special=False)
        async with await cache.branch(prefix + q1) as first:
            assert first.position == len(prefix) + len(q1)
        before = ctx.stats
        async with await cache.branch(prefix + q2) as second:
            decoded = ctx.stats.tokens_decoded - before.tokens_decoded
            # Only the part after the longest shared prefix was decoded.
            shared = next(i for i, (a, b) in enumerate(zip(q1, q2, strict=False)) if a != b)
            assert decoded == len(q2) - shared
            assert second.position == len(prefix) + len(q2)
            # Same distribution as decoding the whole prompt fresh.
            async with lloyal.Branch.create(ctx, lloyal.GREEDY) as fresh:
                await fresh.prefill(prefix + q2)
                assert np.abs(fresh.logits - second.logits).max() < ROUTE_NOISE
                best, runner_up = np.sort(fresh.logits)[-2:][::-1]
                if best - runner_up > ROUTE_NOISE:  # a choice no route can flip
                    assert (await fresh.produce()).token == (await second.produce()).token
        s = cache.stats
        assert (s.requests, s.hits) == (2, 1)
        assert s.saved_tokens == len(prefix) + shared
        assert s.prefilled_tokens == len(prefix) + len(q1) + len(q2) - shared
        assert s.requested_tokens == 2 * len(prefix) + len(q1) + len(q2)
        assert s.entries == 2
        assert 0 < s.hit_rate <= 1
        # The exact prompt again: everything but the last token is reused.
        async with await cache.branch(prefix + q1) as again:
            assert again.position == len(prefix) + len(q1)
        assert cache.stats.saved_tokens == s.saved_tokens + len(prefix) + len(q1) - 1
        await cache.aclose()
        assert lloyal.BranchStore(ctx).available == 6


@pytest.mark.asyncio
async def test_concurrent_requests_share_the_cache_and_their_decodes(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=4096, n_seq_max=12) as ctx:
        cache = lloyal.PrefixCache(ctx, max_branches=4)
        prefix = await ctx.tokenize(SHARED)
        async with await cache.branch(prefix):
            pass

        tails = [
            await ctx.tokenize(f" Question {i}: name a colour.", add_special=False)
            for i in range(6)
        ]

        async def ask(tail: list[int]) -> int:
            async with await cache.branch(prefix + tail) as b:
                return b.position - len(prefix) - len(tail)

        before = ctx.stats
        offsets = await asyncio.gather(*[ask(t) for t in tails])
        assert offsets == [0] * 6
        assert cache.stats.hits == 6
        # Each request decoded its own suffix, nothing of the shared prefix
        # (the forks of the one entry took turns; none found it busy), and
        # suffixes prefilled in the same tick shared a decode (how many did
        # depends on when each task got there: at most one decode each).
        assert ctx.stats.tokens_decoded - before.tokens_decoded == sum(map(len, tails))
        assert ctx.stats.decode_calls - before.decode_calls <= 6
        await cache.aclose()
        assert lloyal.BranchStore(ctx).available == 12


@pytest.mark.asyncio
async def test_eviction_under_lease_pressure_keeps_serving(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=3) as ctx:
        cache = lloyal.PrefixCache(ctx, max_branches=8)
        base = await ctx.tokenize("Shared opening words for every prompt here.")
        held: list[lloyal.Branch] = []
        for i in range(6):
            tail = await ctx.tokenize(f" Prompt number {i}.", add_special=False)
            b = await cache.branch(base + tail)
            assert b.position == len(base) + len(tail)
            held.append(b)
            if len(held) == 2:  # the caller keeps two leases; the cache gets one
                await held.pop(0).prune()
        assert cache.stats.evictions >= 4
        assert len(cache) <= 1
        assert cache.stats.hits >= 4  # each request still reused the last entry
        for b in held:
            await b.prune()
        await cache.clear()
        assert lloyal.BranchStore(ctx).available == 3


@pytest.mark.asyncio
async def test_max_branches_and_max_cells_bound_the_cache(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        cache = lloyal.PrefixCache(ctx, max_branches=2)
        for i in range(4):
            text = f"Entirely different prompt {i} " * (i + 1)
            async with await cache.branch(await ctx.tokenize(text)):
                pass
        assert len(cache) == 2
        assert cache.stats.evictions == 2
        await cache.clear()
        tight = lloyal.PrefixCache(ctx, max_branches=8, max_cells=60)
        for i in range(4):
            async with await tight.branch(await ctx.tokenize(f"Prompt {i} " * 10)):
                pass
            assert store.cells_held <= 60 or len(tight) == 1
        await tight.clear()
        assert store.cells_held == 0
        with pytest.raises(ValueError, match="max_branches"):
            lloyal.PrefixCache(ctx, max_branches=0)
        with pytest.raises(ValueError, match="empty"):
            await tight.branch([])


@pytest.mark.asyncio
async def test_kv_pressure_counts_shared_prefixes_once(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4) as ctx:
        store = lloyal.BranchStore(ctx)
        assert store.kv_pressure == 0.0
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(list(range(100, 200)))
        child = await root.fork()
        await child.prefill(list(range(300, 310)))
        assert store.cells_held == 110
        assert store.kv_pressure == pytest.approx(110 / 1024)
        await child.prune()
        await root.prune()
        assert store.cells_held == 0


@pytest.mark.asyncio
async def test_fork_without_logits_and_as_a_root(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The capital of France is"))
        bare = await root.fork(clone_logits=False)
        with pytest.raises(ValueError, match="logits"):
            await bare.produce()
        await bare.prefill(await ctx.tokenize(" Paris", add_special=False))
        assert (await bare.produce()).token >= 0
        orphan = await root.fork(root=True)
        assert orphan.parent is None
        assert orphan not in root.children
        await bare.prune()
        await root.prune()  # allowed: the other fork is a root of its own
        assert (await orphan.produce()).text == " Paris"
        await orphan.prune()


@pytest.mark.asyncio
async def test_merge_logits_is_the_weighted_sum(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_seq_max=3) as ctx:
        store = lloyal.BranchStore(ctx)
        cond = lloyal.Branch.create(ctx, lloyal.GREEDY)
        uncond = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await store.prefill(
            [
                (cond, await ctx.tokenize("A poem about the sea:")),
                (uncond, await ctx.tokenize("A poem:")),
            ]
        )
        a, b = cond.logits.copy(), uncond.logits.copy()
        store.merge_logits([cond, uncond], [1.5, -0.5])
        # Summed in float64, rounded to float32 once.
        expected = (a.astype(np.float64) * 1.5 + b.astype(np.float64) * -0.5).astype(np.float32)
        assert np.array_equal(cond.logits, expected)
        assert np.array_equal(uncond.logits, b)
        store.merge_logits([uncond], [1.0], into=cond)
        assert np.array_equal(cond.logits, b)
        with pytest.raises(ValueError, match="weight"):
            store.merge_logits([cond, uncond], [1.0])
        with pytest.raises(ValueError, match="finite"):
            store.merge_logits([cond], [float("nan")])
        # Weights whose sum overflows float32 (it once became +inf
        # everywhere, and produce() returned token 0).
        with pytest.raises(ValueError, match="overflows"):
            store.merge_logits([cond, uncond], [1e38, 1e38])
        with pytest.raises(ValueError, match="below \\+inf"):
            cond.set_logits(np.full_like(b, np.inf))
        with pytest.raises(ValueError, match="below \\+inf"):
            cond.set_logits(np.where(np.arange(b.size) == 7, np.nan, b).astype(np.float32))
        assert np.array_equal(cond.logits, b)  # untouched by the refused calls
        # A token one branch masks stays masked, whatever its weight.
        masked = b.copy()
        masked[:100] = -np.inf
        uncond.set_logits(masked)
        store.merge_logits([cond, uncond], [1.5, -0.5])
        assert np.isneginf(cond.logits[:100]).all()
        assert np.isfinite(cond.logits[100:]).all()
        assert (await cond.produce()).token >= 100
        await cond.prune()
        await uncond.prune()


RERANK_DOCS = [
    "Bananas are a good source of potassium.",
    "Paris is the capital and largest city of France.",
    "The stock market closed lower on Tuesday.",
    "Cats sleep for most of the day.",
]


@pytest.mark.asyncio
@pytest.mark.parametrize("model_name", MODELS)
async def test_rerank_puts_the_relevant_document_first_in_fixed_decodes(model_name: str) -> None:
    async with await lloyal.create_context(model_path(model_name), n_ctx=2048, n_seq_max=8) as ctx:
        rerank = lloyal.Rerank(ctx)
        assert rerank.method == "likelihood"
        before = ctx.stats
        scores = await rerank.score("What is the capital of France?", RERANK_DOCS)
        calls = ctx.stats.decode_calls - before.decode_calls
        assert scores.shape == (4,)
        assert scores.dtype == np.float32
        # Measured: the relevant document leads by 0.79 (SmolLM2) and 1.40
        # (Gemma 3) nats per query token, over eight tokens.
        assert int(np.argmax(scores)) == 1
        assert (scores < 0).all()
        # The prompt head once, the four documents together, the query
        # after each of them together: three decodes for any number of
        # documents that fit one batch.
        assert calls == 3
        # With three leases free, the documents go two at a time.
        held = [lloyal.Branch.create(ctx) for _ in range(5)]
        before = ctx.stats
        chunked = await rerank.score("What is the capital of France?", RERANK_DOCS)
        assert ctx.stats.decode_calls - before.decode_calls == 1 + 2 * 2
        assert np.abs(chunked - scores).max() < ROUTE_NOISE
        assert int(np.argmax(chunked)) == 1
        for b in held:
            await b.prune()
        assert (await rerank.score("anything", [])).shape == (0,)
        with pytest.raises(TypeError):
            await rerank.score("query", "not a list")
        assert lloyal.BranchStore(ctx).available == 8


@pytest.mark.asyncio
async def test_rerank_yes_no_asks_the_chat_model_in_one_batch(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=8) as ctx:
        rerank = lloyal.Rerank(ctx, method="yes_no")
        before = ctx.stats
        scores = await rerank.score("What is the capital of France?", RERANK_DOCS)
        # SmolLM2 barely separates relevance this way (why it is not the
        # default), so only the shape of the answer is checked here.
        assert ctx.stats.decode_calls - before.decode_calls == 2
        assert scores.shape == (4,)
        assert ((scores > 0) & (scores < 1)).all()
        with pytest.raises(ValueError, match="query"):
            lloyal.Rerank(ctx, prompt="no slots here")
        with pytest.raises(ValueError, match="end with"):
            lloyal.Rerank(ctx, prompt="{query} then {document}")
        assert lloyal.BranchStore(ctx).available == 8


@pytest.mark.asyncio
async def test_rerank_on_an_embedding_context_uses_cosine_similarity(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, embeddings=True, pooling="mean") as ctx:
        rerank = lloyal.Rerank(ctx)
        assert rerank.method == "embedding"
        docs = ["a kitten sat on the mat", "tax law of the federal republic"]
        scores = await rerank.score("a cat sat", docs)
        rows = await ctx.embed(["a cat sat", *docs])
        assert np.allclose(scores, rows[1:] @ rows[0], atol=1e-5)
        assert scores[0] > scores[1]
    async with await lloyal.create_context(smollm2) as plain:
        with pytest.raises(ValueError, match="embeddings"):
            lloyal.Rerank(plain, method="embedding")
        with pytest.raises(ValueError, match="method"):
            lloyal.Rerank(plain, method="bm25")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_evicted_entries_go_to_disk_and_come_back(smollm2: Path, tmp_path: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=4) as ctx:
        cache = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=tmp_path)
        prefix = await ctx.tokenize(SHARED)
        q1 = await ctx.tokenize(" Question one?", add_special=False)
        q2 = await ctx.tokenize(" Question two?", add_special=False)
        other = await ctx.tokenize("An unrelated prompt about something else entirely.")
        async with await cache.branch(prefix + q1):
            pass
        async with await cache.branch(other):  # evicts the first entry to disk
            pass
        assert cache.stats.disk_entries == 1
        assert len(list(tmp_path.glob("*.state"))) == 1
        before = ctx.stats
        async with await cache.branch(prefix + q2) as b:
            decoded = ctx.stats.tokens_decoded - before.tokens_decoded
            assert b.position == len(prefix) + len(q2)
            async with lloyal.Branch.create(ctx) as fresh:
                await fresh.prefill(prefix + q2)
                assert np.abs(fresh.logits - b.logits).max() < ROUTE_NOISE
        shared = next(i for i, (x, y) in enumerate(zip(q1, q2, strict=False)) if x != y)
        # Restored from disk: only the part after the shared prefix was decoded.
        assert decoded == len(q2) - shared
        assert cache.stats.disk_hits == 1
        await cache.aclose()
        # A new cache on the same folder finds what the first one left.
        again = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=tmp_path)
        assert again.stats.disk_entries == len(list(tmp_path.glob("*.state"))) >= 1
        (tmp_path / "garbage.state").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]junk")
        broken = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=tmp_path)
        async with await broken.branch([1, 2, 3]) as c:  # a damaged file is a miss
            assert c.position == 3
        await again.aclose()
        await broken.aclose()
        assert lloyal.BranchStore(ctx).available == 4


class _FileSizeLimit:
    """RLIMIT_FSIZE, lowered for a test and restored (POSIX only)."""

    def __init__(self) -> None:
        self.limit: tuple[int, int] | None = None

    def set(self, size: int) -> None:
        import resource

        self.limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, self.limit[1]))

    def restore(self) -> None:
        if self.limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, self.limit)


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", ["deleted", "a file", "read-only", "too large"])
async def test_a_failed_disk_write_loses_no_lease(
    smollm2: Path, tmp_path: Path, failure: str
) -> None:
    """Whatever happens to the folder, the request that evicts is served,
    the evicted entry and the new one are pruned in time (no lease is
    lost), and no partial file is left behind. A deleted folder is made
    again; a write that fails is skipped and counted."""
    folder = tmp_path / "cache"
    first, second = list(range(1000, 1040)), list(range(2000, 2040))
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=3) as ctx:
        cache = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=folder)
        async with await cache.branch(first):
            pass
        if sys.platform == "win32" and failure in ("read-only", "too large"):
            pytest.skip("Windows has no read-only folders for their owner, nor RLIMIT_FSIZE")
        fsize = _FileSizeLimit()
        try:
            if failure == "deleted":
                folder.rmdir()
            elif failure == "a file":
                folder.rmdir()
                folder.write_bytes(b"not a folder")
            elif failure == "read-only":
                folder.chmod(0o500)
                if os.access(folder, os.W_OK):
                    pytest.skip("root writes into read-only folders ('too large' fails as root)")
            else:
                fsize.set(4096)
            for _ in range(3):  # each request evicts the one before
                async with await cache.branch(second) as b:
                    assert b.position == len(second)
                    assert lloyal.BranchStore(ctx).available == 1  # b and the entry
                first, second = second, first
        finally:
            fsize.restore()
            if folder.is_dir():
                folder.chmod(0o700)
        s = cache.stats
        if failure == "deleted":
            assert (s.disk_write_errors, s.disk_hits, s.disk_entries) == (0, 2, 1)
            assert [p.suffix for p in folder.iterdir()] == [".state"]
        else:
            assert (s.disk_write_errors, s.disk_hits, s.disk_entries) == (3, 0, 0)
            if failure == "a file":
                assert folder.read_bytes() == b"not a folder"
            else:
                assert list(folder.iterdir()) == []
        await cache.aclose()
        assert lloyal.BranchStore(ctx).available == 3


def _swap_heads(a: Path, b: Path) -> None:
    """Swap what two state files hold before their branch states (the
    tokens header), keeping each one's state."""
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    at_a, at_b = raw_a.index(b"LLOYALKV"), raw_b.index(b"LLOYALKV")
    a.write_bytes(raw_b[:at_b] + raw_a[at_a:])
    b.write_bytes(raw_a[:at_a] + raw_b[at_b:])


# A hang guard (a FIFO in the folder once blocked the constructor), not a speed limit.
@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.asyncio
async def test_a_hostile_cache_folder_gives_misses_or_correct_hits(
    smollm2: Path, tmp_path: Path
) -> None:
    """A folder of junk beside real state files: random bytes, lengths
    far past the end, truncated and bit-flipped copies, two files with
    their token headers swapped, symlinks (to a file, dangling, a loop), a
    FIFO, a folder named like a state file. The cache opens on it without
    error, serves every prompt correctly (from disk only where the file is
    intact), never the swapped files' states, and leaves what is not its
    own alone."""
    rng = random.Random(27)
    prompts = [list(range(k, k + 40)) for k in (1000, 2000, 3000, 4000)]
    async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=4) as ctx:
        writer = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=tmp_path)
        for p in prompts:
            async with await writer.branch(p):
                pass
        await writer.aclose()
        a, b, c = sorted(tmp_path.glob("*.state"))  # the first three prompts, in order
        _swap_heads(a, b)
        good = c.read_bytes()
        for i in range(12):
            (tmp_path / f"random-{i}.state").write_bytes(rng.randbytes(rng.randrange(0, 4096)))
        for at in (0, 8, 16, 24):
            huge = good[:at] + b"\xff" * 8 + good[at + 8 :]
            (tmp_path / f"huge-{at}.state").write_bytes(huge)
        for i in range(6):
            (tmp_path / f"cut-{i}.state").write_bytes(good[: rng.randrange(len(good))])
            flipped = bytearray(good)
            flipped[rng.randrange(len(good))] ^= 1 << rng.randrange(8)
            (tmp_path / f"flip-{i}.state").write_bytes(bytes(flipped))
        (tmp_path / "link.state").symlink_to(c)
        (tmp_path / "dangling.state").symlink_to(tmp_path / "nowhere")
        (tmp_path / "loop.state").symlink_to(tmp_path / "loop.state")
        os.mkfifo(tmp_path / "fifo.state")
        (tmp_path / "x.state").mkdir()
        later = c.stat().st_mtime + 60  # the intact file is the newest for its prompt
        os.utime(c, (later, later))

        cache = lloyal.PrefixCache(ctx, max_branches=1, disk_dir=tmp_path)
        # The swapped files pass the header check (their lengths match); the
        # checksum over the whole file refuses them when they are restored.
        assert cache.stats.disk_entries == 3
        for i, p in enumerate(prompts):
            hits = cache.stats.disk_hits
            async with await cache.branch(p) as served, lloyal.Branch.create(ctx) as fresh:
                await fresh.prefill(p)
                assert np.abs(fresh.logits - served.logits).max() < ROUTE_NOISE
            assert cache.stats.disk_hits - hits == (1 if i == 2 else 0)
        await cache.aclose()
        for name in ("link.state", "dangling.state", "loop.state", "fifo.state", "x.state"):
            assert os.path.lexists(tmp_path / name)
        assert lloyal.BranchStore(ctx).available == 4


@pytest.mark.asyncio
async def test_keep_makes_a_finished_branch_the_entry(smollm2: Path) -> None:
    """``branch(remember=False)`` caches nothing; ``keep`` makes the branch
    itself the entry for what it holds (no fork: no lease more), a later
    prompt sharing it decodes only the rest, and keeping tokens already
    cached prunes the branch. A mismatched token list is refused."""
    async with await lloyal.create_context(smollm2, n_seq_max=4) as ctx:
        cache = lloyal.PrefixCache(ctx)
        store = lloyal.BranchStore(ctx)
        prompt = await ctx.tokenize("A conversation about lighthouses. " * 4)
        b = await cache.branch(prompt, remember=False)
        assert len(cache) == 0
        assert store.available == 3
        reply = (await b.produce()).token
        await b.commit(reply)
        with pytest.raises(ValueError, match="the branch holds"):
            await cache.keep(b, prompt)
        await cache.keep(b, [*prompt, reply])
        assert len(cache) == 1
        assert store.available == 3
        decoded = ctx.stats.tokens_decoded
        nxt = await cache.branch([*prompt, reply, *prompt[1:4]], remember=False)
        assert ctx.stats.tokens_decoded - decoded == 3
        other = await nxt.fork()
        await other.truncate(len(prompt) + 1)
        await cache.keep(other, [*prompt, reply])  # cached already: pruned
        assert other.disposed
        assert len(cache) == 1
        await nxt.prune()
        await cache.aclose()
        assert store.available == 4


@pytest.mark.asyncio
async def test_rerank_refuses_an_empty_query_and_fits_documents_to_the_cache(
    smollm2: Path,
) -> None:
    long_docs = [w * 200 for w in ("word ", "other ", "thing ")]
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        rerank = lloyal.Rerank(ctx)
        # The default prompt puts a space before the query: an empty one
        # was once scored as " ".
        for query in ("", "   "):
            with pytest.raises(ValueError, match="empty"):
                await rerank.score(query, RERANK_DOCS)
        # A prompt that starts with the document (no head to decode).
        first = lloyal.Rerank(ctx, prompt="{document}\nQuestion: {query}")
        scores = await first.score("What is the capital of France?", RERANK_DOCS)
        assert int(np.argmax(scores)) == 1
        # Three documents of 400 tokens fit 512 cells one at a time, not
        # together: they are scored in parts that fit, as alone.
        together = await rerank.score("What is it?", long_docs)
        alone = [float((await rerank.score("What is it?", [d]))[0]) for d in long_docs]
        assert np.abs(together - np.array(alone)).max() < ROUTE_NOISE
        # One that does not fit even alone is still an error.
        with pytest.raises(lloyal.KVCacheFullError):
            await rerank.score("What is it?", ["word " * 600])
        assert lloyal.BranchStore(ctx).available == 4
