"""BranchStore and implicit batching, proved with decode counters."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import lloyal
import numpy as np
import pytest

from tests.conftest import ROUTE_NOISE, route_distance, top1_margin

pytestmark = pytest.mark.anyio


async def fan_out(
    ctx: lloyal.Context, n: int, prompt: str = "Once upon a time"
) -> list[lloyal.Branch]:
    root = lloyal.Branch.create(ctx, params=lloyal.SamplingParams(seed=3))
    await root.prefill(await ctx.tokenize(prompt))
    return [await root.fork() for _ in range(n)]


async def test_store_commit_of_8_branches_is_one_decode(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=1024, n_seq_max=9) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = await fan_out(ctx, 8)
        items = [(k, (await k.produce()).token) for k in kids]
        before = ctx.stats
        await store.commit(items)
        after = ctx.stats
        assert after.decode_calls - before.decode_calls == 1
        assert after.tokens_decoded - before.tokens_decoded == 8
        assert all(k.position == kids[0].fork_head + 1 for k in kids)


async def test_gathered_commits_from_8_tasks_are_one_decode(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=1024, n_seq_max=9) as ctx:
        kids = await fan_out(ctx, 8)
        tokens = [(await k.produce()).token for k in kids]
        before = ctx.stats.decode_calls
        async with anyio.create_task_group() as tg:
            for k, t in zip(kids, tokens, strict=True):
                tg.start_soon(k.commit, t)
        assert ctx.stats.decode_calls - before == 1
        # And again, for several steps of lockstep generation.
        before = ctx.stats.decode_calls

        async def step(b: lloyal.Branch) -> None:
            await b.commit((await b.produce()).token)

        for _ in range(3):
            async with anyio.create_task_group() as tg:
                for k in kids:
                    tg.start_soon(step, k)
        assert ctx.stats.decode_calls - before == 3


async def test_prefill_packs_into_ceil_total_over_n_batch(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=1024, n_batch=16, n_seq_max=6) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = await fan_out(ctx, 4, "Explain quantum entanglement")
        prefixes = [
            "Think of it like two coins that always land the same way",
            "In quantum mechanics, the state of",
            "What happens when you measure one particle",
            "Imagine two particles",
        ]
        items = [
            (k, await ctx.tokenize(p, add_special=False))
            for k, p in zip(kids, prefixes, strict=True)
        ]
        total = sum(len(t) for _, t in items)
        start = [k.position for k in kids]
        before = ctx.stats.decode_calls
        await store.prefill(items)
        assert ctx.stats.decode_calls - before == math.ceil(total / ctx.n_batch)
        for k, s, (_, t) in zip(kids, start, items, strict=True):
            assert k.position == s + len(t)
        # Each branch got the logits of its own last token: compare with a
        # fork of the same prefix prefilled alone. That is another route (a
        # batch of its own), so each logit within ROUTE_NOISE and the
        # same argmax where the best two are ROUTE_NOISE apart
        # (tests/conftest.py); another branch's row would be far off.
        for k, (_, t) in zip(kids, items, strict=True):
            solo = await k.parent.fork()  # type: ignore[union-attr]
            await solo.prefill(t)
            np.testing.assert_allclose(k.logits, solo.logits, rtol=0, atol=ROUTE_NOISE)
            if top1_margin(solo.logits) >= ROUTE_NOISE:
                assert int(solo.logits.argmax()) == int(k.logits.argmax())
            await solo.prune()


async def test_a_pruned_branch_in_a_batch_does_not_sink_the_rest(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=5) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = await fan_out(ctx, 3)
        items = [(k, (await k.produce()).token) for k in kids]
        await kids[1].prune()
        with pytest.raises(lloyal.BranchDisposedError):
            await store.commit(items)
        assert kids[0].position == kids[2].position == kids[0].fork_head + 1


async def test_commit_returns_each_items_outcome_when_asked(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=5) as ctx:
        store = lloyal.BranchStore(ctx)
        kids = await fan_out(ctx, 3)
        items = [(k, (await k.produce()).token) for k in kids]
        await kids[1].prune()
        before = ctx.stats.decode_calls
        outcomes = await store.commit(items, return_exceptions=True)
        assert outcomes[0] is None
        assert outcomes[2] is None
        assert isinstance(outcomes[1], lloyal.BranchDisposedError)
        assert kids[0].position == kids[2].position == kids[0].fork_head + 1
        assert ctx.stats.decode_calls - before == 1
        # All well: one None per item.
        live = [kids[0], kids[2]]
        items = [(k, (await k.produce()).token) for k in live]
        assert await store.commit(items, return_exceptions=True) == [None, None]


async def test_kv_exhaustion_rolls_back_every_branch(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_batch=32, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill((await ctx.tokenize("word " * 200))[:200])
        kids = [await root.fork() for _ in range(7)]
        # 7 branches x 10 private tokens = 70 cells, but only 56 are left:
        # the first 32-token decode succeeds, the second fails, and the
        # first one's cells must go again.
        items = [(k, (await ctx.tokenize(" again" * 10, add_special=False))[:10]) for k in kids]
        snapshot = [(k.position, k.perplexity, k.logits.copy()) for k in kids]
        with pytest.raises(lloyal.KVCacheFullError):
            await store.prefill(items)
        for k, (pos, ppl, logits) in zip(kids, snapshot, strict=True):
            assert k.position == pos
            assert k.perplexity == ppl
            assert (k.logits == logits).all()
        # Fewer branches fit, and then work normally.
        await store.prefill(items[:4])
        assert all(k.position == 210 for k in kids[:4])
        t = (await kids[0].produce()).token
        await kids[0].commit(t)


async def test_cancelled_commits_leave_branches_before_or_after(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=9) as ctx:
        kids = await fan_out(ctx, 8)
        start = kids[0].position
        tokens = [(await k.produce()).token for k in kids]
        async with anyio.create_task_group() as tg:
            for i, (k, t) in enumerate(zip(kids, tokens, strict=True)):
                tg.start_soon(k.commit, t)
                if i % 2:
                    await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        # Let submitted work finish, then check every branch is whole.
        while any(k._busy for k in kids):  # noqa: ASYNC110 - polling the worker
            await anyio.sleep(0.01)
        for k in kids:
            assert k.position in (start, start + 1)
            if k.position == start + 1:
                assert not k.disposed
        # Every branch is usable afterwards, whichever side it landed on.
        store = lloyal.BranchStore(ctx)
        await store.commit([(k, (await k.produce()).token) for k in kids])


async def test_a_prefill_given_up_is_not_decoded_and_leaves_the_branch_as_it_was(
    smollm2: Path,
) -> None:
    """A prefill cancelled while it waits on the worker (held, so on a
    machine of any speed) is given up: the worker decodes none of it, and
    the branch is as it was, and usable. It used to decode the whole prompt
    for nobody (issue 48, item 8)."""
    async with await lloyal.create_context(smollm2, n_ctx=2048) as ctx:
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(await ctx.tokenize("Once upon a time"))
        start, logits = b.position, np.array(b.logits)
        long = await ctx.tokenize(
            "The quick brown fox jumps over the lazy dog. " * 40, add_special=False
        )
        before = ctx.stats.tokens_decoded
        cells = ctx._native.branch_cells_held()
        hold = ctx._native.hold()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.prefill, long)
                await anyio.wait_all_tasks_blocked()  # sent, and waiting
                tg.cancel_scope.cancel()
        finally:
            hold.release()
        while b._busy:  # noqa: ASYNC110 - polling the worker (hang guard: the test's timeout)
            await anyio.sleep(0.01)
        assert ctx.stats.tokens_decoded == before
        assert ctx._native.branch_cells_held() == cells
        assert b.position == start
        np.testing.assert_array_equal(b.logits, logits)
        await b.prefill(long)
        assert b.position == start + len(long)


async def test_fork_prune_cycles_leak_no_lease(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("A short prefix"))
        for _ in range(200):
            child = await root.fork()
            await child.commit((await child.produce()).token)
            await child.prune()
        assert store.available == ctx.n_seq_max - 1
        assert root.children == []


async def test_forks_share_prefix_cells(model: Path) -> None:
    """Forking copies no KV cells: 8 forks of a 1000-token prefix fit in a
    2048-cell cache with room for 960 more tokens. (Copied prefixes would
    need 9 x 1000 cells.)"""
    async with await lloyal.create_context(model, n_ctx=2048, n_batch=512, n_seq_max=9) as ctx:
        assert ctx.n_ctx == 2048
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        prefix = (await ctx.tokenize("the cat sat on the mat " * 300))[:1000]
        await store.prefill([(root, prefix)])
        kids = [await root.fork() for _ in range(8)]
        more = (await ctx.tokenize(" and then" * 100, add_special=False))[:120]
        await store.prefill([(k, more) for k in kids])
        assert all(k.position == 1120 for k in kids)
        # The pool really is nearly full now: another 120 per branch is not.
        with pytest.raises(lloyal.KVCacheFullError):
            await store.prefill([(k, more) for k in kids])


async def test_retain_only_leaves_flat_sequences_alone(smollm2: Path) -> None:
    """Sequence 0 used through the flat API is not a branch's: retain_only
    frees the losing branches' cells and keeps it."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4) as ctx:
        flat = await ctx.tokenize("The flat loop owns this sequence.")
        await ctx.decode(flat, 0)
        kids = await fan_out(ctx, 2)
        store = lloyal.BranchStore(ctx)
        await store.retain_only(kids[0])
        assert ctx.kv_cache_size(0) == len(flat)
        assert store.available == ctx.n_seq_max - 2  # not kids[0]'s, not seq 0
        await ctx.decode(await ctx.tokenize(" More", add_special=False), len(flat))
        assert kids[1].disposed


async def test_a_full_cache_fails_only_the_commits_that_do_not_fit(smollm2: Path) -> None:
    """Commits from separate tasks merge into one decode; when the cache
    cannot take them all, the ones that fit still land."""
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill([100 + i % 50 for i in range(ctx.n_ctx - 2)])  # 2 cells free
        branches = [root, *[await root.fork() for _ in range(3)]]
        before = [b.position for b in branches]
        failed: list[BaseException] = []

        async def commit(b: lloyal.Branch) -> None:
            try:
                await b.commit(7)
            except lloyal.LloyalError as e:
                failed.append(e)

        async with anyio.create_task_group() as tg:
            for b in branches:
                tg.start_soon(commit, b)
        assert len(failed) == 2
        assert all(isinstance(e, lloyal.KVCacheFullError) for e in failed)
        after = [b.position for b in branches]
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 0, 1, 1]


def _whole_state(b: lloyal.Branch) -> tuple[object, ...]:
    """Everything a failed batch must leave as it was, bit for bit."""
    return (
        b.position,
        b.logits.tobytes(),
        b.sampler_state(),
        b.perplexity,
        b.sampling_perplexity,
    )


async def test_an_explicit_commit_that_overflows_restores_every_branch(model: Path) -> None:
    """Seven forks commit in lockstep until the cache is full: the failing
    ``store.commit`` is all or nothing (no branch advanced, every logits
    bit, sampler stream and perplexity as before), and the context goes on."""
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.SamplingParams(seed=5, temperature=0.8))
        await root.prefill(await ctx.tokenize("Once upon a time"))
        kids = [await root.fork() for _ in range(7)]
        for i, k in enumerate(kids):
            k.reseed_sampler(i)
        for _ in range(ctx.n_ctx):  # the cache is full long before
            items = [(k, (await k.produce()).token) for k in kids]
            before = [_whole_state(k) for k in kids]
            try:
                await store.commit(items)
            except lloyal.KVCacheFullError:
                break
        else:
            pytest.fail("the cache never filled")
        assert [_whole_state(k) for k in kids] == before
        # One branch fewer fits: the others commit the same tokens now.
        await kids[-1].prune()
        await kids[-2].prune()
        await store.commit(items[:5])
        assert [k.position for k in kids[:5]] == [before[0][0] + 1] * 5


async def test_an_explicit_prefill_that_overflows_restores_every_branch(model: Path) -> None:
    """A ``store.prefill`` spanning several decodes (n_batch=16) whose last
    decode does not fit: every branch is as before, bits included."""
    async with await lloyal.create_context(model, n_ctx=256, n_batch=16, n_seq_max=5) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill((await ctx.tokenize("word " * 200))[:200])
        kids = [await root.fork() for _ in range(4)]
        await store.commit([(k, 100 + i) for i, k in enumerate(kids)])
        more = (await ctx.tokenize(" again" * 20, add_special=False))[:15]
        before = [_whole_state(k) for k in kids]
        with pytest.raises(lloyal.KVCacheFullError):
            await store.prefill([(k, more) for k in kids])  # 60 cells, 52 free
        assert [_whole_state(k) for k in kids] == before
        await store.prefill([(k, more) for k in kids[:3]])
        assert [k.position for k in kids] == [216, 216, 216, 201]


async def test_merged_groups_of_two_tasks_do_not_fail_each_other(smollm2: Path) -> None:
    """One task's ``store.commit`` of five branches and another task's single
    commit go in one step; only four cells are free. The merged decode
    fails, the groups are retried apart: the single commit lands, the
    five-branch batch fails whole (none of its branches moved)."""
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill([100 + i % 50 for i in range(20)])
        filler = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await filler.prefill([200 + i % 50 for i in range(ctx.n_ctx - 20 - 4)])  # 4 cells free
        single, *five = [await root.fork() for _ in range(6)]
        outcome: dict[str, object] = {}

        async def commit_one() -> None:
            await single.commit(7)
            outcome["single"] = "ok"

        async def commit_five() -> None:
            try:
                await store.commit([(b, 8) for b in five])
            except lloyal.KVCacheFullError as e:
                outcome["five"] = e

        before = ctx.stats.decode_calls
        async with anyio.create_task_group() as tg:
            tg.start_soon(commit_five)
            tg.start_soon(commit_one)
        # Merged (fails), then each group alone: the single fits, the five do not.
        assert ctx.stats.decode_calls - before == 3
        assert outcome["single"] == "ok"
        assert isinstance(outcome["five"], lloyal.KVCacheFullError)
        assert single.position == 21
        assert [b.position for b in five] == [20] * 5


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_long_prompt_joins_running_streams_in_chunks(model: Path) -> None:
    """A 1,000-token prompt prefilled while 31 streams generate is decoded in
    chunks of at most n_batch tokens that share decodes with the streams'
    commits, and ends as the same prompt prefilled alone would (the same
    logits up to the route noise of tests/conftest.py). How long a stream
    can wait is counted exactly in the engine's own test (tests/aio.rs:
    commits wait behind at most one round)."""
    n_batch = 64
    async with await lloyal.create_context(model, n_ctx=4096, n_batch=n_batch, n_seq_max=34) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("Count: one, two, three"))
        streams = [await root.fork() for _ in range(31)]
        prompt = (await ctx.tokenize("the cat sat on the mat " * 200))[:1000]
        late = lloyal.Branch.create(ctx, lloyal.GREEDY)
        prefilled = anyio.Event()
        made = [0] * len(streams)

        async def stream(i: int, b: lloyal.Branch) -> None:
            while not prefilled.is_set():
                await b.commit((await b.produce()).token)
                made[i] += 1

        async def prefill() -> None:
            await anyio.lowlevel.checkpoint()
            await late.prefill(prompt)
            prefilled.set()

        calls, tokens = ctx.stats.decode_calls, ctx.stats.tokens_decoded
        async with anyio.create_task_group() as tg:
            for i, b in enumerate(streams):
                tg.start_soon(stream, i, b)
            tg.start_soon(prefill)
        decodes = ctx.stats.decode_calls - calls
        decoded = ctx.stats.tokens_decoded - tokens
        assert late.position == 1000
        assert decoded == 1000 + sum(made)
        assert decodes >= -(-decoded // n_batch)  # no decode held more than n_batch
        alone = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await alone.prefill(prompt)
        assert route_distance(late.logits, alone.logits) <= ROUTE_NOISE
        if top1_margin(alone.logits) > 2 * ROUTE_NOISE:
            assert int(np.argmax(late.logits)) == int(np.argmax(alone.logits))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_step_budget_bounds_every_decode_and_changes_no_result(model: Path) -> None:
    """With ``ctx.step_tokens`` set, a round decodes the commits waiting and
    then prompt tokens up to the budget (at least a quarter of it): a
    200-token prompt submitted with 8 streams' commits is one decode of 512
    tokens without a budget and 1 + ceil((200 - 24) / 32) = 7 decodes with a
    budget of 32, each of at most 32 tokens; the prompt's logits are the
    same up to the route noise either way. Commits that fill the budget
    still leave prompts a quarter of it. Bad budgets raise and change
    nothing."""
    async with await lloyal.create_context(model, n_ctx=2048, n_batch=512, n_seq_max=10) as ctx:
        assert ctx.step_tokens is None
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("Count: one, two, three"))
        streams = [await root.fork() for _ in range(8)]
        prompt = (await ctx.tokenize("the cat sat on the mat " * 60))[:200]
        logits = {}

        async def round_trip(budget: int | None) -> tuple[int, int]:
            ctx.step_tokens = budget
            late = lloyal.Branch.create(ctx, lloyal.GREEDY)
            picks = await store.produce(streams)
            calls, tokens = ctx.stats.decode_calls, ctx.stats.tokens_decoded
            # Held, the worker takes both as one step (on any machine).
            hold = ctx._native.hold()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(late.prefill, prompt)
                    tg.start_soon(
                        store.commit, [(b, p.token) for b, p in zip(streams, picks, strict=True)]
                    )
                    await anyio.wait_all_tasks_blocked()
                    hold.release()
            finally:
                hold.release()
            assert late.position == 200
            logits[budget] = late.logits
            await late.prune()
            return ctx.stats.decode_calls - calls, ctx.stats.tokens_decoded - tokens

        assert await round_trip(None) == (1, 208)
        assert await round_trip(32) == (7, 208)
        assert ctx.step_tokens == 32
        assert np.abs(logits[32] - logits[None]).max() <= ROUTE_NOISE
        # 8 commits fill a budget of 8: the prompt still gets 2 tokens
        # beside them, then 8 a round.
        assert await round_trip(8) == (1 + 25, 208)
        # Larger than n_batch: n_batch.
        ctx.step_tokens = 10_000
        assert ctx.step_tokens == ctx.n_batch
        for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)):
            with pytest.raises(error):
                ctx.step_tokens = bad  # type: ignore[assignment]
            assert ctx.step_tokens == ctx.n_batch
        ctx.step_tokens = None
        assert ctx.step_tokens is None
        assert [b.position for b in streams] == [root.position + 3] * 8


async def test_store_produce_chooses_every_token_in_one_call(model: Path) -> None:
    """``store.produce`` gives what each branch's own ``produce`` would: the
    same greedy tokens, grammar-constrained tokens for grammar branches
    (sampled off the loop, in parallel), and a failing branch fails alone."""
    async with await lloyal.create_context(model, n_ctx=1024, n_seq_max=8) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The answer, as JSON:"))
        plain = [await root.fork() for _ in range(2)]
        constrained = [await root.fork() for _ in range(2)]
        for b in constrained:
            b.set_grammar(lark='start: "true" | "false"')
        gone = await root.fork()
        await gone.prune()
        picks = await store.produce([*plain, *constrained, gone], return_exceptions=True)
        assert isinstance(picks[-1], lloyal.BranchDisposedError)
        own = [await b.produce() for b in [*plain, *constrained]]
        assert [p.token for p in picks[:-1]] == [p.token for p in own]  # type: ignore[union-attr]
        for p in picks[2:4]:
            assert isinstance(p, lloyal.Produced)
            assert "true".startswith(p.text) or "false".startswith(p.text)
        with pytest.raises(lloyal.BranchDisposedError):
            await store.produce([plain[0], gone])
        # The branches are free again: they commit what they chose.
        await store.commit([(b, p.token) for b, p in zip(plain, own[:2], strict=True)])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_many_commits_over_many_cells_are_one_decode(model: Path) -> None:
    """64 commits of 64 sequences are one decode, whether few KV cells are in
    use or each sequence holds 100 cells of its own. (Before the project's
    flash attention patch, patches/llama.cpp/0001-*, the worker split the
    second case into decodes of at most 63 tokens: llama.cpp's tiled kernel
    attended to every cell in use. The patched kernel reads only each row's
    cells: docs/batching.md, "Many sequences".)"""
    async with await lloyal.create_context(model, n_ctx=256 * 65, n_seq_max=65, n_batch=512) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The history of the printing press"))
        kids = [await root.fork() for _ in range(64)]
        before = ctx.stats.decode_calls
        await store.commit([(k, 100 + i) for i, k in enumerate(kids)])
        assert ctx.stats.decode_calls - before == 1
        await store.prefill(
            [(k, [200 + (i + j) % 300 for j in range(100)]) for i, k in enumerate(kids)]
        )
        before = ctx.stats.decode_calls
        await store.commit([(k, 100 + i) for i, k in enumerate(kids)])
        assert ctx.stats.decode_calls - before == 1
        assert {k.position for k in kids} == {root.position + 102}


async def test_logprobs_of_many_branches_in_one_call_match_each_branch(model: Path) -> None:
    """``store.logprobs`` gives, per (branch, token), what ``logprobs`` and
    ``top_logprobs`` of that branch give (the same computation, one call);
    a bad token or ``top`` raises and reads nothing."""
    async with await lloyal.create_context(model, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The capital of France is"))
        a, b = await root.fork(), await root.fork()
        await b.commit(int(b.top_logprobs(2)[0][1]))  # b's distribution differs
        store = lloyal.BranchStore(ctx)
        items = [(root, 5), (a, int(a.top_logprobs(1)[0][0])), (b, 11)]
        read = store.logprobs(items, top=5)
        for (branch, token), (lp, ids, lps) in zip(items, read, strict=True):
            assert lp == float(branch.logprobs([token])[0])
            tokens, logprobs = branch.top_logprobs(5)
            assert ids == tokens.tolist()
            assert lps == logprobs.tolist()
        assert [len(ids) for _, ids, _ in store.logprobs(items)] == [0, 0, 0]
        with pytest.raises(ValueError, match=r"vocabulary|token"):
            store.logprobs([(root, ctx.vocab_size)])
        with pytest.raises(ValueError, match="top"):
            store.logprobs(items, top=-1)
