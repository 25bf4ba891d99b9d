"""Branch: fork, produce/commit, topology, leases, errors -- on both models
(Gemma 3 exercises sliding-window attention)."""

from __future__ import annotations

from pathlib import Path

import anyio
import lloyal
import numpy as np
import pytest

from tests.conftest import COUNTING, ROUTE_NOISE, Greedy, branch_greedy, top1_margin

pytestmark = pytest.mark.anyio

PROMPT = "The old lighthouse keeper climbed the stairs and"


async def greedy_tokens(branch: lloyal.Branch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        p = await branch.produce()
        await branch.commit(p.token)
        out.append(p.token)
    return out


async def test_fork_shares_prefix_and_continues_identically(model: Path, model_name: str) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        prompt = await ctx.tokenize(COUNTING[model_name])  # wide greedy margins
        await root.prefill(prompt)
        assert root.position == len(prompt)
        child = await root.fork()
        assert child.position == root.position == child.fork_head
        assert child.parent is root
        assert root.children == [child]
        assert not root.is_leaf
        assert child.is_leaf
        np.testing.assert_array_equal(child.logits, root.logits)  # a copy
        assert child.perplexity == root.perplexity
        # Same greedy continuation from the shared prefix. The root's cells
        # come after the child's, another route: the same tokens up to the
        # first near-tie (tests/conftest.py), and the same perplexity up to
        # ROUTE_NOISE in each surprisal.
        ours = await branch_greedy(child, 6)
        theirs = await branch_greedy(root, 6)
        ours.check(theirs.tokens, at_least=6)
        if theirs.tokens == ours.tokens:
            assert np.log(child.perplexity) == pytest.approx(
                np.log(root.perplexity), abs=ROUTE_NOISE
            )


async def test_forks_without_reseed_match_and_reseeded_forks_diverge(smollm2: Path) -> None:
    params = lloyal.SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=5, n_gpu_layers=0) as ctx:
        root = lloyal.Branch.create(ctx, params=params)
        await root.prefill(await ctx.tokenize(PROMPT))
        a, b = await root.fork(), await root.fork()
        drawn = await greedy_tokens(a, 12)
        # Same route, so the same bits: with `a` pruned, `b` decodes the same
        # tokens into the same cells, one per decode. Only the draws are tested.
        await a.prune()
        assert await greedy_tokens(b, 12) == drawn
        c, d = await root.fork(), await root.fork()
        c.reseed_sampler(1)
        d.reseed_sampler(2)
        assert await greedy_tokens(c, 12) != await greedy_tokens(d, 12)


async def test_batched_decode_matches_decoding_alone(model: Path, model_name: str) -> None:
    """A branch decoded with 7 siblings gets the greedy text it gets when
    decoded alone, and logits within route noise of those."""
    # A batch of 8 and a single token are different routes: CPU kernels
    # round differently by batch layout (docs/determinism.md), so the test
    # allows ROUTE_NOISE (tests/conftest.py). CUDA's kernels differ more
    # (docs/gpu.md): this test keeps to the CPU.
    async with await lloyal.create_context(model, n_ctx=1024, n_seq_max=9, n_gpu_layers=0) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(COUNTING[model_name]))  # wide greedy margins
        alone = await root.fork()
        alone_tokens, alone_logits, margins = [], [], []
        for _ in range(4):
            margins.append(top1_margin(alone.logits))
            p = await alone.produce()
            await alone.commit(p.token)
            alone_tokens.append(p.token)
            alone_logits.append(alone.logits.copy())
        await alone.prune()
        family = [await root.fork() for _ in range(8)]
        for b, word in zip(
            family[1:], [" red", " blue", " seven", " ship", " and", " the", " x"], strict=True
        ):
            b.steer({(await ctx.tokenize(word, add_special=False))[0]: 50.0})
        together_tokens = []
        for step in range(4):
            produced = [(b, (await b.produce()).token) for b in family]
            await store.commit(produced)
            together_tokens.append(produced[0][1])
            if together_tokens == alone_tokens[: step + 1]:
                # The same tokens by another route: each logit within ROUTE_NOISE.
                np.testing.assert_allclose(
                    family[0].logits, alone_logits[step], rtol=0, atol=ROUTE_NOISE
                )
        # The same tokens up to the first near-tie.
        Greedy(alone_tokens, margins, []).check(together_tokens, at_least=4)


async def test_async_iteration_stops_at_eog(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=2) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": "Say OK."}])
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(chat.prompt))
        pieces = []
        async for tok in root:
            pieces.append(tok.text)
            if len(pieces) > 60:
                break
        assert 0 < len(pieces) <= 61
        assert "".join(pieces).strip()


async def test_prune_restrict_and_cascade(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx)
        await root.prefill(await ctx.tokenize(PROMPT))
        child = await root.fork()
        grandchild = await child.fork()
        assert store.available == 1
        with pytest.raises(ValueError, match="live children"):
            await root.prune()
        assert not root.disposed
        await root.prune_subtree()
        assert root.disposed
        assert child.disposed
        assert grandchild.disposed
        assert store.available == 4
        for dead in (root, child, grandchild):
            with pytest.raises(lloyal.BranchDisposedError):
                await dead.produce()
            with pytest.raises(lloyal.BranchDisposedError):
                await dead.commit(5)
            with pytest.raises(lloyal.BranchDisposedError):
                _ = dead.position
        # A new branch reuses the slot; the old handles stay dead.
        fresh = lloyal.Branch.create(ctx)
        assert root.disposed
        assert not fresh.disposed


async def test_retain_only_frees_every_other_lease(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=6) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kids = [await root.fork() for _ in range(5)]
        assert store.available == 0
        await store.commit([(k, (await k.produce()).token) for k in kids])
        winner = kids[2]
        await store.retain_only(winner)
        assert store.available == ctx.n_seq_max - 1
        assert winner.parent is None
        assert all(b.disposed for b in [root, *kids] if b is not winner)
        # The winner still decodes from its whole prefix.
        assert len(await greedy_tokens(winner, 3)) == 3


async def test_no_lease_error_says_how_to_free_one(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
        root = lloyal.Branch.create(ctx)
        await root.prefill(await ctx.tokenize("hi"))
        kid = await root.fork()
        with pytest.raises(lloyal.NoLeaseError, match="all 2 KV leases"):
            await root.fork()
        with pytest.raises(lloyal.NoLeaseError, match="prune"):
            lloyal.Branch.create(ctx)
        assert root.position == len(await ctx.tokenize("hi"))
        assert not kid.disposed


async def test_two_operations_in_flight_are_refused(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=2) as ctx:
        root = lloyal.Branch.create(ctx)
        prompt = await ctx.tokenize("word " * 200)
        results: list[object] = []

        async def prefill() -> None:
            try:
                await root.prefill(prompt)
                results.append("ok")
            except lloyal.BranchBusyError as e:
                results.append(e)

        # The held worker keeps the first prefill queued (in flight) while
        # the second is submitted, on a machine of any speed.
        hold = ctx._native.hold()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(prefill)
                tg.start_soon(prefill)
                await anyio.wait_all_tasks_blocked()
                hold.release()
        finally:
            hold.release()
        assert results.count("ok") == 1
        assert sum(isinstance(r, lloyal.BranchBusyError) for r in results) == 1
        assert root.position == len(prompt)


async def test_fork_and_prune_run_at_once_when_the_worker_is_idle(
    model: Path, model_name: str
) -> None:
    """An idle worker lets fork and prune finish without suspending (no
    thread hand-off); the result is the same as through the worker."""
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(COUNTING[model_name]))  # wide greedy margins
        fork = root.fork()
        with pytest.raises(StopIteration) as done:
            fork.send(None)  # completes on the first step: nothing awaited
        child = done.value.value
        assert isinstance(child, lloyal.Branch)
        assert child.parent is root
        assert child.position == root.position
        np.testing.assert_array_equal(child.logits, root.logits)  # a copy
        # The root's cells come after the child's, another route: the same
        # tokens up to the first near-tie (tests/conftest.py).
        (await branch_greedy(child, 3)).check((await branch_greedy(root, 3)).tokens, at_least=3)
        prune = child.prune()
        with pytest.raises(StopIteration):
            prune.send(None)
        assert child.disposed
        assert root.children == []
        assert lloyal.BranchStore(ctx).available == 2


async def test_fork_and_prune_run_between_the_rounds_of_a_running_step(smollm2: Path) -> None:
    """While the worker decodes a long prompt (several rounds of n_batch
    tokens), a fork and a prune of other branches are submitted as jobs and
    run between its rounds, without waiting for it to end; a fork of the
    branch being decoded is refused."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4, n_batch=64) as ctx:
        a = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        b = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await a.prefill(await ctx.tokenize(PROMPT))
        long_prompt = await ctx.tokenize("word " * 300)
        before = ctx.stats.decode_calls
        outcome: dict[str, object] = {}

        async def prefill_b() -> None:
            await b.prefill(long_prompt)
            outcome["b"] = b.position

        async def fork_during() -> None:
            with pytest.raises(lloyal.BranchBusyError):
                await b.fork()
            child = await a.fork()  # queued, but ahead of the prefill's rounds
            assert ctx.stats.decode_calls == before
            assert "b" not in outcome
            outcome["child"] = child.position
            await child.prune()
            outcome["pruned"] = child.disposed

        # The held worker stands for a long decode on a machine of any speed.
        hold = ctx._native.hold()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(prefill_b)
                await anyio.wait_all_tasks_blocked()  # b's prefill is queued
                tg.start_soon(fork_during)
                await anyio.wait_all_tasks_blocked()  # a's fork is queued behind it
                assert ctx.stats.decode_calls == before
                hold.release()
        finally:
            hold.release()
        assert outcome == {"b": len(long_prompt), "child": a.position, "pruned": True}
        assert ctx.stats.decode_calls - before == -(-len(long_prompt) // 64)
        assert lloyal.BranchStore(ctx).available == 2


async def test_prune_queued_behind_a_retain_only_that_disposes_the_branch(
    smollm2: Path,
) -> None:
    """A prune submitted while the worker is busy, behind a retain_only that
    then disposes of the same branch, succeeds: the branch is gone, as asked
    (cleanup after a cancelled strategy relies on this). A prune called
    after the branch was disposed raises, like any use of a disposed one."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        keep, loser = await root.fork(), await root.fork()
        store = lloyal.BranchStore(ctx)

        async def prune_loser() -> None:
            await loser.prune()  # must not raise

        # Hold the worker so that both are queued, in this order, before
        # either runs (trio does not run tasks in spawn order).
        hold = ctx._native.hold()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(store.retain_only, keep)  # disposes of `loser`
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(prune_loser)
                await anyio.wait_all_tasks_blocked()
                hold.release()
        finally:
            hold.release()
        assert loser.disposed
        assert not keep.disposed
        assert store.available == 3
        with pytest.raises(lloyal.BranchDisposedError):
            await loser.prune()


async def test_sampler_controls(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        best = (await root.produce()).token
        assert not root.set_sampler_params(lloyal.GREEDY)
        assert root.set_sampler_params(lloyal.GREEDY.with_(top_k=5))
        assert root.sampler_params.top_k == 5
        # Steering is per branch; a logit bias is inherited.
        root.steer({best: -1000.0})
        assert (await root.produce()).token != best
        child = await root.fork()
        assert (await child.produce()).token == best
        root.steer({})
        root.set_logit_bias({best: -1000.0})
        grandchild = await root.fork()
        assert (await grandchild.produce()).token != best
        # Custom logits.
        edited = np.full(ctx.vocab_size, -np.inf, dtype=np.float32)
        edited[123] = 0.0
        child.set_logits(edited)
        assert (await child.produce()).token == 123
        assert child.model_surprisal(123) == pytest.approx(0.0, abs=1e-6)
        assert child.model_entropy("bits") == pytest.approx(0.0, abs=1e-6)


async def test_perplexity_is_from_the_sampling_distribution(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        tokens = await ctx.tokenize(PROMPT)
        await root.prefill(tokens[:-1])
        surprisal = root.model_surprisal(tokens[-1])
        await root.commit(tokens[-1])
        assert root.perplexity == pytest.approx(np.exp(surprisal), rel=1e-5)
        # Greedy sampling puts all mass on the argmax: a forced other token is
        # impossible under the sampling distribution.
        assert root.sampling_perplexity in (1.0, float("inf"))


async def test_greedy_choice_follows_the_logits_sampling_sees(model: Path) -> None:
    """The worker precomputes each greedy branch's argmax with its logits,
    and its log-sum-exp in the background, rows spread over llama.cpp's
    threads; edited logits, biases and steering bypass that precomputed
    choice."""
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=5) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kids = [await root.fork() for _ in range(4)]
        store = lloyal.BranchStore(ctx)
        await store.commit([(k, t) for k, t in zip(kids, [11, 12, 13, 14], strict=True)])
        # Read at once: the log-sum-exps may still be summed in the
        # background on llama.cpp's threads (a reader then computes its own).
        early = [k.model_surprisal(3) for k in kids]
        for k, s in zip(kids, early, strict=True):
            row = np.array(k.logits, dtype=np.float64)
            lse = row.max() + np.log(np.exp(row - row.max()).sum())
            assert s == pytest.approx(lse - row[3], rel=1e-5, abs=1e-6)
            assert k.model_surprisal(3) == s  # the same bits once cached
        for k in kids:
            assert (await k.produce()).token == int(np.argmax(k.logits))
        edited = np.array(kids[0].logits)
        edited[5] = edited.max() + 10
        kids[0].set_logits(edited)
        assert (await kids[0].produce()).token == 5
        kids[1].set_logit_bias({7: 1e4})
        assert (await kids[1].produce()).token == 7
        kids[2].steer({9: 1e4})
        assert (await kids[2].produce()).token == 9
        # Perplexity after the batched commit: from each row's own logits.
        logits = np.array(kids[3].logits, dtype=np.float64)
        token = int(np.argmax(logits))
        lse = logits.max() + np.log(np.exp(logits - logits.max()).sum())
        before = kids[3].perplexity
        await kids[3].commit(token)
        surprisal = np.log(kids[3].perplexity) * 2 - np.log(before)
        assert surprisal == pytest.approx(lse - logits[token], rel=1e-4, abs=1e-5)


async def test_async_with_prunes_the_subtree(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=4) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx)
        await root.prefill(await ctx.tokenize("hello"))
        async with await root.fork() as child:
            grandchild = await child.fork()
            assert store.available == 1
        assert child.disposed
        assert grandchild.disposed
        assert store.available == 3
        assert root.children == []


async def test_leaving_async_with_after_a_cancelled_operation_frees_the_lease(
    smollm2: Path,
) -> None:
    """The prune on exit queues behind the cancelled (still running)
    operation instead of failing with BranchBusyError."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=2) as ctx:
        prompt = await ctx.tokenize("word " * 150)
        store = lloyal.BranchStore(ctx)
        for i in range(12):
            async with lloyal.Branch.create(ctx) as b:
                # Meant to expire, not a hang guard: the cancel lands
                # somewhere in the prefill or the loop (where, the machine
                # decides); every landing place must free the lease.
                with anyio.move_on_after(0.002 * i):
                    await b.prefill(prompt)
                    while True:
                        await b.commit((await b.produce()).token)
            assert b.disposed
            assert store.available == 2


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_dropped_unpruned_branches_give_their_leases_back(smollm2: Path) -> None:
    """A Branch garbage-collected without prune() frees its lease and cells
    (with a ResourceWarning, like an unclosed file); a fork keeps its
    parent's object alive."""
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        store = lloyal.BranchStore(ctx)

        async def cycles(n: int) -> None:
            for _ in range(n):
                b = lloyal.Branch.create(ctx, lloyal.GREEDY)
                await b.prefill([1, 2, 3])
                kid = await b.fork()
                del b, kid

        with pytest.warns(ResourceWarning, match="unpruned lloyal.Branch"):
            await cycles(1000)
        assert store.available == 4
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kid = await root.fork()
        del root  # a fork keeps its parent's object alive: nothing is freed
        assert kid.parent is not None
        assert not kid.parent.disposed
        await kid.commit((await kid.produce()).token)
        assert store.available == 2
        with pytest.warns(ResourceWarning):
            del kid  # and then both go
        assert store.available == 4


async def test_pruned_descendants_are_not_kept_alive(smollm2: Path) -> None:
    import gc
    import weakref

    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill([1, 2, 3])
        kids = [await root.fork() for _ in range(3)]
        refs = [weakref.ref(k) for k in kids]
        _ = [k.children for k in kids], root.children  # the registry in use
        await root.prune_subtree()
        del kids, _
        gc.collect()
        assert all(r() is None for r in refs)


async def test_a_slow_sampler_runs_off_the_event_loop(model: Path) -> None:
    """top_k=0 sorts the whole vocabulary (about 9 ms on Gemma 3): produce()
    runs it on a worker thread, so other tasks run meanwhile; greedy
    sampling stays on the loop. (bench/loop_lag.py measures the stalls.)"""
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        ticks = 0

        async def count_ticks(b: lloyal.Branch) -> int:
            nonlocal ticks
            ticks = 0
            running = True

            async def ticker() -> None:
                nonlocal ticks
                while running:
                    await anyio.lowlevel.checkpoint()
                    ticks += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                await anyio.lowlevel.checkpoint()
                before = ticks
                await b.produce()
                during = ticks - before
                running = False
            return during

        for params, off_loop in (
            (lloyal.SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=1), True),
            (lloyal.GREEDY, False),
        ):
            b = lloyal.Branch.create(ctx, params)
            await b.prefill(await ctx.tokenize(PROMPT))
            during = await count_ticks(b)
            assert (during > 0) == off_loop, (params, during)
            await b.prune()


async def test_top_logprobs_and_logprobs_match_the_logits_row(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as ctx:
        b = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await b.prefill(await ctx.tokenize(PROMPT))
        row = b.logits.astype(np.float64)
        m = row.max()
        logp = row - (m + np.log(np.sum(np.exp(row - m))))
        # Reference order: most likely first, ties by lower id.
        order = np.lexsort((np.arange(row.size), -row))
        tokens, lps = b.top_logprobs(50)
        assert tokens.dtype == np.int32
        assert lps.dtype == np.float64
        assert tokens.tolist() == order[:50].tolist()
        np.testing.assert_allclose(lps, logp[order[:50]], rtol=0, atol=1e-6)
        assert int(tokens[0]) == (await b.produce()).token  # greedy
        picks = [int(order[0]), int(order[7]), int(order[-1])]
        np.testing.assert_allclose(b.logprobs(picks), logp[picks], rtol=0, atol=1e-6)
        assert b.logprobs(picks)[1] == pytest.approx(-b.model_surprisal(picks[1]), abs=1e-12)
        assert b.top_logprobs(0)[0].size == 0
        assert b.top_logprobs(10**9)[0].size == ctx.vocab_size
        # Bad input: typed errors, the branch unchanged.
        with pytest.raises(ValueError, match="k must be >= 0"):
            b.top_logprobs(-1)
        with pytest.raises(ValueError, match="out of range"):
            b.logprobs([ctx.vocab_size])
        assert b.top_logprobs(1)[0].tolist() == [int(order[0])]
        empty = lloyal.Branch.create(ctx)
        with pytest.raises(ValueError, match="no logits"):
            empty.top_logprobs(3)
        await empty.prune()
        with pytest.raises(lloyal.BranchDisposedError):
            empty.top_logprobs(3)
        await b.prune()


async def test_a_sampler_run_off_the_loop_keeps_its_random_stream(model: Path) -> None:
    """produce() on the sampler thread writes the advanced random stream
    back: the same seed gives the same tokens as sampling on the loop."""
    params = lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, params)
        await root.prefill(await ctx.tokenize(PROMPT))
        off, on = await root.fork(), await root.fork()
        assert off._produce_now() is None  # slow: produce() takes it off the loop
        via_thread = [(await off.produce()).token for _ in range(6)]
        on_loop = [on._produce_now(inline=True)[0] for _ in range(6)]  # type: ignore[index]
        assert via_thread == on_loop
        assert len(set(via_thread)) > 1  # really sampled, not one token
        await off.commit(via_thread[-1])  # the branch is not left busy
        await root.prune_subtree()


@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
async def test_fork_at_is_a_fork_and_a_truncate_in_one(model_name: str) -> None:
    """``fork(at=k)`` holds the first k positions and no logits; prefilling
    the rest follows the parent's route (greedy, up to the first near-tie).
    A bad ``at`` raises and changes nothing."""
    from lloyal.models import model_path

    async with await lloyal.create_context(model_path(model_name), n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        tokens = await ctx.tokenize(COUNTING[model_name])
        await root.prefill(tokens)
        k = len(tokens) - 3
        child = await root.fork(at=k)
        assert child.position == k
        with pytest.raises(ValueError, match="no logits"):
            _ = child.logits
        with pytest.raises(ValueError, match="at must be in"):
            await root.fork(at=len(tokens) + 1)
        with pytest.raises(ValueError, match="at must be in"):
            await root.fork(at=-1)
        assert lloyal.BranchStore(ctx).available == 2  # the refused forks took nothing
        await child.prefill(tokens[k:])
        assert child.position == root.position
        (await branch_greedy(child, 3)).check((await branch_greedy(root, 3)).tokens, at_least=3)


async def test_forks_are_made_at_once_and_share_a_round_with_their_prefill(
    smollm2: Path,
) -> None:
    """While the worker is busy, forks return at once (their KV copies are
    queued), several forks of one branch may be in flight, any other
    operation on it is refused meanwhile, and a child's prefill submitted
    right after its fork goes into the same round as the other children's."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=4) as ctx:
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        tokens = await ctx.tokenize(PROMPT)
        await root.prefill(tokens)
        suffix = await ctx.tokenize(" the sea", add_special=False)
        before = ctx.stats.decode_calls
        hold = ctx._native.hold()
        try:
            a = await root.fork(at=len(tokens) - 1)
            b = await root.fork(at=len(tokens) - 1)
            with pytest.raises(lloyal.BranchBusyError):
                await root.commit(5)
            store = lloyal.BranchStore(ctx)
            pending = [store.prefill([(a, suffix), (b, suffix)])]
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: pending[0])
                await anyio.wait_all_tasks_blocked()
                hold.release()
        finally:
            hold.release()
        assert ctx.stats.decode_calls - before == 1
        assert a.position == b.position == len(tokens) - 1 + len(suffix)
        np.testing.assert_array_equal(a.logits, b.logits)
        await root.commit(5)  # free again


async def test_a_prune_right_after_a_prefill_waits_for_it(smollm2: Path) -> None:
    """A prefill issued in a task is handed to the worker at the end of the
    tick; a prune issued before then waits for it (it used to see an idle
    worker, dispose of the branch at once and fail the prefill with
    ``BranchDisposedError``). docs/cancellation.md's promise."""
    async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=2) as ctx:
        prompt = await ctx.tokenize("The quick brown fox jumps over the lazy dog.")
        x = lloyal.Branch.create(ctx, lloyal.GREEDY)
        outcome: list[BaseException | None] = []
        issuing = anyio.Event()

        async def prefill() -> None:
            try:
                issuing.set()  # this task goes on into prefill without yielding
                await x.prefill(prompt)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(prefill)
            await issuing.wait()  # the prefill is issued, not yet sent to the worker
            await x.prune()
        assert outcome == [None]
        assert x.disposed
        assert lloyal.BranchStore(ctx).available == 2
