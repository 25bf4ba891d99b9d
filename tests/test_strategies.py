"""lloyal.strategies on real models: each strategy's defining property,
its decode count, and that it gives every lease back."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import lloyal
import numpy as np
import pytest
from lloyal import strategies
from lloyal.models import model_path

from tests.conftest import COUNTING, ROUTE_NOISE, greedy_reference, open_sync

CHAT = "Name the largest planet in the solar system."
MODEL = {"smol": "smollm2", "gemma": "gemma3"}


@pytest.fixture(scope="module")
def smol() -> Iterator[lloyal.Context]:
    ctx = open_sync(model_path("smollm2"), n_ctx=1024, n_seq_max=8)
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def smol_draft() -> Iterator[lloyal.Context]:
    ctx = open_sync(model_path("smollm2"), n_ctx=1024)
    yield ctx
    ctx.close()


@pytest.fixture(scope="module")
def gemma() -> Iterator[lloyal.Context]:
    ctx = open_sync(model_path("gemma3"), n_ctx=1024, n_seq_max=8)
    yield ctx
    ctx.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def chat_prompt(ctx: lloyal.Context, text: str) -> tuple[str, tuple[int, ...]]:
    template = None if ctx.model_info.has_chat_template else "gemma"
    chat = ctx.format_chat([{"role": "user", "content": text}], template=template)
    return chat.prompt, chat.stop_tokens


def all_leases_free(ctx: lloyal.Context) -> bool:
    return lloyal.BranchStore(ctx).available == ctx.n_seq_max


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_beam_width_1_is_greedy(which: str, request: pytest.FixtureRequest) -> None:
    ctx: lloyal.Context = request.getfixturevalue(which)
    prompt, stop = chat_prompt(ctx, CHAT)
    greedy = run(strategies.generate(ctx, prompt, max_tokens=12, stop=stop))
    beam = run(strategies.beam_search(ctx, prompt, width=1, max_tokens=12, stop=stop))
    # Same route, so the same bits: both start from an empty cache, prefill
    # the prompt in one decode and commit one token per decode into the same
    # cells. Exact tokens; the surprisals differ only in arithmetic (numpy's
    # float64 log-softmax in beam_search, the core's in generate).
    assert beam.tokens == greedy.tokens
    assert beam.text == greedy.text
    assert beam.output.surprisals == pytest.approx(greedy.output.surprisals, abs=1e-4)
    assert beam.decode_calls == greedy.decode_calls
    assert beam.peak_leases == 1
    assert all_leases_free(ctx)


def test_wider_beams_find_likelier_continuations(smol: lloyal.Context) -> None:
    prompt, stop = chat_prompt(smol, CHAT)
    greedy = run(strategies.beam_search(smol, prompt, width=1, max_tokens=8, stop=stop))
    wide = run(strategies.beam_search(smol, prompt, width=3, max_tokens=8, stop=stop))
    assert len(wide.beams) == 3
    # Up to route noise: three forks decoded in one batch are another route
    # than one branch alone, and each token's log-probability may differ by
    # ROUTE_NOISE between them (tests/conftest.py).
    assert wide.output.log_prob >= greedy.output.log_prob - ROUTE_NOISE * len(greedy.tokens)
    # The same search's own numbers, summed two ways: the same route.
    assert list(wide.scores) == sorted(wide.scores, reverse=True)
    for beam, score in zip(wide.beams, wide.scores, strict=True):
        if not beam.stopped:
            assert beam.log_prob == pytest.approx(score)
    # One decode per step for all beams: the prefill plus 7 commits.
    assert wide.decode_calls <= 8
    assert all_leases_free(smol)


def test_speculative_with_a_draft_model_is_the_targets_greedy_output(
    smol: lloyal.Context, smol_draft: lloyal.Context
) -> None:
    prompt = COUNTING["smollm2"]  # wide margins: see tests/conftest.py
    greedy = run(greedy_reference(smol, prompt, 16))
    spec = run(strategies.speculative_decode(smol, prompt, draft=smol_draft, k=4, max_tokens=16))
    # The draft (one token per decode) and the verification (a packed batch)
    # are other routes than the greedy reference: the same tokens up to the
    # first near-tie (ROUTE_NOISE in tests/conftest.py).
    greedy.check(spec.tokens, at_least=8)
    assert 0.0 <= spec.acceptance_rate <= 1.0
    assert spec.decode_calls == spec.rounds + 1  # the prompt prefill, then one per round
    assert spec.draft_decode_calls > 0
    if greedy.all_sure and len(greedy.tokens) == 16:
        # The same model drafts and no step is a near-tie: every draft is
        # accepted, 5 tokens per round.
        assert spec.acceptance_rate == 1.0
        assert spec.rounds == math.ceil(16 / 5)
    assert all_leases_free(smol)
    assert smol_draft.kv_cache_size(0) == 0


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_speculative_with_prompt_lookup_is_greedy(
    which: str, request: pytest.FixtureRequest
) -> None:
    ctx: lloyal.Context = request.getfixturevalue(which)
    prompt = COUNTING[MODEL[which]]  # wide margins, and lookup finds the pattern
    greedy = run(greedy_reference(ctx, prompt, 16))
    spec = run(strategies.speculative_decode(ctx, prompt, k=4, max_tokens=16))
    # The verification batch is another route than the greedy reference: the
    # same tokens up to the first near-tie, and surprisals within ROUTE_NOISE
    # of the reference's there (tests/conftest.py).
    n = greedy.check(spec.tokens, at_least=8)
    assert spec.output.surprisals[:n] == pytest.approx(greedy.surprisals[:n], abs=ROUTE_NOISE)
    assert 0.0 <= spec.acceptance_rate <= 1.0
    assert spec.accepted <= spec.drafted
    assert spec.draft_decode_calls == 0
    if greedy.all_sure:
        # The target's choices are the reference's, and those repeat the prompt.
        assert spec.rounds < 16  # lookup drafts some of the counting
    assert all_leases_free(ctx)


def test_speculative_sampling_is_seeded(smol: lloyal.Context, smol_draft: lloyal.Context) -> None:
    def once(seed: int) -> strategies.Speculative:
        return run(  # type: ignore[no-any-return]
            strategies.speculative_decode(
                smol, CHAT, draft=smol_draft, k=3, max_tokens=8, temperature=0.8, seed=seed
            )
        )

    # Same route twice (both contexts empty at the start), so the same bits.
    a, b = once(1), once(1)
    assert a.tokens == b.tokens
    assert 0.0 <= a.acceptance_rate <= 1.0
    assert len(a.tokens) == 8 or a.output.stopped


def test_speculative_verifies_k_plus_one_tokens_and_leaves_other_branches(
    smol: lloyal.Context, smol_draft: lloyal.Context
) -> None:
    """Verification reads every position's logits from one decode of the
    pending token and the k drafts (it used to fork once per draft and
    re-decode each fork's prefix: (k+1)(k+2)/2 tokens). One lease."""

    async def main() -> tuple[strategies.Speculative, int, int]:
        bystander = lloyal.Branch.create(smol, lloyal.GREEDY)
        await bystander.prefill(await smol.tokenize("A branch minding its own business"))
        position = bystander.position
        prompt_tokens = len(await smol.tokenize(COUNTING["smollm2"]))
        before = smol.stats.tokens_decoded
        spec = await strategies.speculative_decode(
            smol, COUNTING["smollm2"], draft=smol_draft, k=8, max_tokens=24
        )
        decoded = smol.stats.tokens_decoded - before - (prompt_tokens - 1)
        assert bystander.position == position
        await bystander.commit((await bystander.produce()).token)
        await bystander.prune()
        return spec, decoded, prompt_tokens

    spec, decoded, _ = run(main())
    assert spec.rounds >= 1
    # Each round decodes the pending token plus at most k drafts.
    assert decoded == spec.rounds + spec.drafted
    assert decoded <= spec.rounds * (8 + 1)
    assert all_leases_free(smol)
    with pytest.raises(ValueError, match="different context"):
        run(strategies.speculative_decode(smol, CHAT, draft=smol))


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_best_of_n_picks_the_lowest_perplexity(which: str, request: pytest.FixtureRequest) -> None:
    ctx: lloyal.Context = request.getfixturevalue(which)
    prompt, stop = chat_prompt(ctx, "Write a one-line motto.")
    params = lloyal.SamplingParams(temperature=1.0)
    result = run(strategies.best_of_n(ctx, prompt, n=3, max_tokens=8, params=params, stop=stop))
    ppl = [c.perplexity for c in result.candidates]
    assert len(set(ppl)) == 3  # independent random streams
    assert result.best_index == int(np.argmin(ppl))
    assert result.output is result.candidates[result.best_index]
    for c in result.candidates:
        assert c.perplexity == pytest.approx(math.exp(np.mean(c.surprisals)))
        assert len(c.entropies) == len(c.tokens)
    # Lockstep: one decode per step for all candidates.
    assert result.decode_calls <= 8
    assert all_leases_free(ctx)


def test_best_of_n_is_reproducible_and_checks_leases(smol: lloyal.Context) -> None:
    # Same route twice, so the same bits and the same draws.
    a = run(strategies.best_of_n(smol, "Once upon a time", n=2, max_tokens=6, seed=7))
    b = run(strategies.best_of_n(smol, "Once upon a time", n=2, max_tokens=6, seed=7))
    assert [c.tokens for c in a.candidates] == [c.tokens for c in b.candidates]
    with pytest.raises(ValueError, match="n_seq_max >= 9"):
        run(strategies.best_of_n(smol, "x", n=8))


def test_sample_tree_decodes_one_batch_per_level(smol: lloyal.Context) -> None:
    tree = run(strategies.sample_tree(smol, "The capital of France is", width=2, depth=3))
    paths = tree.paths()
    assert len(paths) == 8
    assert tree.decode_calls == 3  # prefill + 2 levels; the leaves need no decode
    first = [n.log_prob for n in tree.roots]
    assert first == sorted(first, reverse=True)
    best = max(paths, key=lambda p: p[-1].log_prob)
    assert tree.output.tokens == tuple(n.token for n in best)
    assert tree.output.log_prob == pytest.approx(best[-1].log_prob)
    assert all_leases_free(smol)


def test_mcts_scores_rollouts_and_returns_the_best(smol: lloyal.Context) -> None:
    seen: list[str] = []

    async def score(text: str) -> float:
        seen.append(text)
        return float(text.count("e"))

    result = run(
        strategies.mcts(
            smol, "My favourite word is", score, iterations=3, width=2, rollout_tokens=4
        )
    )
    assert result.rollouts == len(seen) == 6
    assert result.score == max(s.count("e") for s in seen)
    assert result.text in seen
    assert sum(r.visits for r in result.roots) == 6
    assert all_leases_free(smol)


def test_parallel_mcts_on_one_context(smol: lloyal.Context) -> None:
    """Tree parallelism on one context: two iterations at once, each
    scored and backed up; the lease need grows by ``width`` per extra
    runner and is checked before anything runs."""
    seen: list[str] = []

    def score(text: str) -> float:
        seen.append(text)
        return float(text.count("e"))

    result = run(
        strategies.mcts(
            smol,
            "My favourite word is",
            score,
            iterations=3,
            width=2,
            rollout_tokens=3,
            parallel=2,
        )
    )
    assert result.iterations == 3
    assert result.rollouts == len(seen)
    assert sum(r.visits for r in result.roots) == len(seen)
    assert result.score == max(s.count("e") for s in seen)
    assert all_leases_free(smol)
    with pytest.raises(ValueError, match=r"mcts\(iterations=4, parallel=2\) needs 9 free"):
        run(strategies.mcts(smol, "Hi", len, iterations=4, width=2, parallel=2))
    assert all_leases_free(smol)


@pytest.mark.parametrize("name", ["best_of_n", "beam_search"])
def test_a_strategy_runs_on_a_context_or_a_pool_only(name: str) -> None:
    with pytest.raises(TypeError, match=r"runs on a lloyal\.Context or a lloyal\.cluster"):
        run(getattr(strategies, name)(object(), "Hi"))


AFTER = (1, 3)  # cancel after this many decodes


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelled_strategies_give_every_lease_back(
    backend: str, smol: lloyal.Context, smol_draft: lloyal.Context
) -> None:
    prompt = "Once upon a time"
    calls = [
        lambda: strategies.best_of_n(smol, prompt, n=3, max_tokens=16),
        lambda: strategies.beam_search(smol, prompt, width=2, max_tokens=16),
        lambda: strategies.speculative_decode(smol, prompt, draft=smol_draft, max_tokens=40),
        lambda: strategies.mcts(smol, prompt, len, iterations=4, rollout_tokens=8),
    ]

    async def cancel_mid_run(start: Any, after: int) -> bool:
        """Cancel once the strategy has made ``after`` decodes; True if it was cut short."""
        begin = smol.stats.decode_calls
        finished = False
        async with anyio.create_task_group() as tg:

            async def strategy() -> None:
                nonlocal finished
                await start()
                finished = True
                tg.cancel_scope.cancel()

            tg.start_soon(strategy)
            # Poll the native decode counter (there is no event to wait on)
            # at every turn of the loop, not on a timer: the strategy needs a
            # turn of the loop between decodes too, so the poll sees the
            # count before the strategy gets far past it, however fast or
            # busy the machine.
            while smol.stats.decode_calls < begin + after:
                await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        return not finished

    async def main() -> None:
        for start in calls:
            for after in AFTER:
                assert await cancel_mid_run(start, after)
                assert all_leases_free(smol)
                assert smol_draft.kv_cache_size(0) == 0
        # And the context still works.
        result = await strategies.generate(smol, prompt, max_tokens=2)
        assert len(result.tokens) == 2

    anyio.run(main, backend=backend)
