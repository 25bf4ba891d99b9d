"""The flat decode loop: decode, logits, sampling, entropy, perplexity."""

from __future__ import annotations

from pathlib import Path

import lloyal
import numpy as np
import pytest

from tests.conftest import COUNTING, ROUTE_NOISE, top1_margin

pytestmark = pytest.mark.anyio

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


async def greedy_continuation(
    ctx: lloyal.Context, prompt: list[int], n: int, seq: int = 0
) -> list[int]:
    await ctx.decode(prompt, 0, seq)
    out: list[int] = []
    for _ in range(n):
        token = ctx.greedy_sample()
        out.append(token)
        await ctx.decode([token], len(prompt) + len(out) - 1, seq)
    return out


async def test_greedy_generation_is_deterministic(model: Path) -> None:
    # Same route twice (fresh contexts, the same calls): the same bits.
    runs = []
    for _ in range(2):
        async with await lloyal.create_context(model, n_ctx=256) as ctx:
            prompt = await ctx.tokenize(PROMPT)
            runs.append(await greedy_continuation(ctx, prompt, 12))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


async def test_greedy_sample_equals_sampler_at_temperature_zero(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        assert ctx.sample(lloyal.GREEDY) == ctx.greedy_sample() == int(np.argmax(ctx.get_logits()))


async def test_one_call_equals_token_by_token(model: Path, model_name: str) -> None:
    """Decoding a sequence in one call or one token at a time gives nearly
    the same logits, and predicts the same next token when it is clear."""
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as ctx:
        tokens = await ctx.tokenize(COUNTING[model_name])  # a clear next token
        await ctx.decode(tokens, 0, seq_id=0)
        batched = ctx.get_logits()
        for i, t in enumerate(tokens):
            await ctx.decode([t], i, seq_id=1)
        stepwise = ctx.get_logits()
    # Two routes: batched and single-token matmuls round differently
    # (quantised activations), by an amount that varies with the host CPU.
    # Each logit stays within ROUTE_NOISE, and the argmax is the same
    # when the best two are ROUTE_NOISE apart (tests/conftest.py).
    np.testing.assert_allclose(stepwise, batched, rtol=0, atol=ROUTE_NOISE)
    if top1_margin(batched) >= ROUTE_NOISE:
        assert int(np.argmax(batched)) == int(np.argmax(stepwise))


async def test_logits_are_a_read_only_copy(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        tokens = await ctx.tokenize(PROMPT)
        await ctx.decode(tokens, 0)
        first = ctx.get_logits()
        assert first.dtype == np.float32
        assert first.shape == (ctx.vocab_size,)
        assert not first.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            first[0] = 1.0
        kept = first.copy()
        await ctx.decode([ctx.greedy_sample()], len(tokens))
        np.testing.assert_array_equal(first, kept)
        assert not np.array_equal(ctx.get_logits(), kept)


async def test_surprisal_and_entropy_match_numpy(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        logits = ctx.get_logits()
        lsm = log_softmax(logits)
        for token in [0, int(np.argmax(logits)), ctx.vocab_size - 1, 1234]:
            assert ctx.model_surprisal(token) == pytest.approx(-lsm[token], abs=1e-4)
            assert ctx.model_surprisal(token, "bits") == pytest.approx(
                -lsm[token] / np.log(2), abs=1e-4
            )
        p = np.exp(lsm)
        entropy = float(-(p * lsm).sum())
        assert ctx.model_entropy() == pytest.approx(entropy, abs=1e-4)
        assert ctx.model_entropy("bits") == pytest.approx(entropy / np.log(2), abs=1e-4)
        # The same measures on edited logits.
        edited = logits.copy()
        edited[: ctx.vocab_size // 2] = -np.inf
        lsm2 = log_softmax(edited)
        top = int(np.argmax(edited))
        assert ctx.model_surprisal(top, logits=edited) == pytest.approx(-lsm2[top], abs=1e-4)


async def test_perplexity_tracker_matches_numpy(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        tokens = await ctx.tokenize(PROMPT)
        tracker = ctx.create_perplexity_tracker()
        assert tracker.perplexity == float("inf")
        assert tracker.count == 0
        await ctx.decode(tokens[:1], 0)
        surprisals = []
        for i, token in enumerate(tokens[1:], start=1):
            s = ctx.model_surprisal(token)
            surprisals.append(-log_softmax(ctx.get_logits())[token])
            tracker.add(s)
            await ctx.decode([token], i)
        assert tracker.count == len(tokens) - 1
        assert tracker.perplexity == pytest.approx(float(np.exp(np.mean(surprisals))), rel=1e-5)
        clone = tracker.clone()
        tracker.reset()
        assert tracker.count == 0
        assert clone.count == len(tokens) - 1
        with pytest.raises(ValueError, match="non-negative"):
            tracker.add(-1.0)


async def test_seeded_sampling_is_reproducible_and_varies(smollm2: Path) -> None:
    params = lloyal.SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=123)

    async def draws(p: lloyal.SamplingParams) -> list[int]:
        async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
            await ctx.decode(await ctx.tokenize(PROMPT), 0)
            return [ctx.sample(p) for _ in range(20)]

    a, b = await draws(params), await draws(params)
    assert a == b  # same route (fresh contexts, the same calls): the same bits
    assert len(set(a)) > 1
    assert await draws(params.with_(seed=124)) != a


async def test_sampling_filters(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        logits = ctx.get_logits()
        top5 = set(np.argsort(logits)[-5:].tolist())
        hot = lloyal.SamplingParams(temperature=3.0, top_k=5, top_p=1.0, min_p=0.0, seed=1)
        assert {ctx.sample(hot) for _ in range(50)} <= top5
        # top_p: only the smallest set of tokens whose mass reaches p.
        order = np.argsort(logits)[::-1]
        probs = np.exp(log_softmax(logits))[order]
        nucleus = set(order[: int(np.searchsorted(np.cumsum(probs), 0.5)) + 1].tolist())
        tp = lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=2)
        assert {ctx.sample(tp) for _ in range(50)} <= nucleus
        # min_p: only tokens with p >= min_p * p_max.
        p = np.exp(log_softmax(logits))
        allowed = set(np.nonzero(p >= 0.2 * p.max())[0].tolist())
        mp = lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=3)
        assert {ctx.sample(mp) for _ in range(50)} <= allowed
        typ = lloyal.SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.2, seed=4
        )
        assert len({ctx.sample(typ) for _ in range(30)}) >= 1


async def test_penalties_use_the_persistent_history(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        logits = ctx.get_logits()
        best = int(np.argmax(logits))
        ctx.sample(lloyal.GREEDY)  # records `best` in the history
        penalised = lloyal.SamplingParams(temperature=0.0, presence_penalty=1000.0)
        assert ctx.sample(penalised, logits=logits) != best
        ctx.reset_sampler()
        assert ctx.sample(penalised, logits=logits) == best


async def test_sample_from_edited_logits(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        edited = np.full(ctx.vocab_size, -np.inf, dtype=np.float32)
        edited[42] = 0.0
        assert ctx.sample(lloyal.SamplingParams(seed=0), logits=edited) == 42
        # float64 and lists are converted.
        assert ctx.sample(lloyal.GREEDY, logits=edited.astype(np.float64)) == 42


async def test_sampler_options_have_their_defining_effects(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize(PROMPT), 0)
        logits = ctx.get_logits()
        order = np.argsort(logits)[::-1]
        base = lloyal.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=9)
        # logit_bias: a large bias forces a token; dicts and pairs both work.
        forced = int(order[500])
        assert ctx.sample(base.with_(logit_bias={forced: 100.0}), logits=logits) == forced
        assert lloyal.SamplingParams(logit_bias=[(3, 1.5)]).logit_bias == ((3, 1.5),)
        with pytest.raises(ValueError, match="out of range"):
            ctx.sample(base.with_(logit_bias={ctx.vocab_size + 1: 1.0}), logits=logits)
        # top-n-sigma: only tokens within n standard deviations of the best.
        finite = logits[np.isfinite(logits)]
        allowed = set(np.nonzero(logits >= logits.max() - 1.0 * finite.std())[0].tolist())
        tns = base.with_(top_n_sigma=1.0)
        assert {ctx.sample(tns, logits=logits) for _ in range(40)} <= allowed
        # XTC at probability 1: the top choices above the threshold are cut,
        # so the argmax is never drawn when two or more tokens exceed it.
        p = np.exp(logits - logits.max())
        p /= p.sum()
        threshold = float(np.sort(p)[-2]) * 0.99
        xtc = base.with_(xtc_probability=1.0, xtc_threshold=threshold)
        assert int(order[0]) not in {ctx.sample(xtc, logits=logits) for _ in range(40)}
        # Mirostat 2.0 with a tiny target keeps only the near-certain head:
        # the first draw is the argmax.
        ctx.reset_sampler()
        miro = base.with_(mirostat=2, mirostat_tau=0.05, mirostat_eta=0.1)
        assert ctx.sample(miro, logits=logits) == int(order[0])
        with pytest.raises(ValueError, match="mirostat"):
            lloyal.SamplingParams(mirostat=1)


async def test_dry_breaks_a_verbatim_loop(model: Path) -> None:
    """DRY's defining effect: the token that would extend a repeat loses."""
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        tokens = await ctx.tokenize(
            "red green blue cyan red green blue cyan red green blue cyan red"
        )
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(tokens[:1])
        for t in tokens[1:]:
            await b.commit(t)  # accepted: the history DRY reads
        # The token that extends the loop (" green" after " red"), made the
        # greedy choice by a steer so the test does not hang on the model.
        loop = tokens[tokens.index(tokens[-1]) + 1]
        b.steer({loop: 8.0})
        assert (await b.produce()).token == loop
        b.set_sampler_params(lloyal.GREEDY.with_(dry_multiplier=2.0))
        assert (await b.produce()).token != loop
        # Breakers end repeats: if every token containing a space breaks
        # them, nothing repeats long enough and the loop wins again.
        b.set_sampler_params(lloyal.GREEDY.with_(dry_multiplier=2.0, dry_sequence_breakers=(" ",)))
        assert (await b.produce()).token == loop
        with pytest.raises(ValueError, match="dry_base"):
            lloyal.SamplingParams(dry_base=0.5)
        with pytest.raises(TypeError):
            lloyal.SamplingParams(dry_sequence_breakers="\n")
