""":func:`best_of_n`: N samples in lockstep, the least perplexed wins."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    _check_positive,
    _need_leases,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
    _stopper,
)


@dataclass(frozen=True)
class BestOfN(_Output):
    """What :func:`best_of_n` returns: every candidate, and the winner
    (``candidates[best_index]``, the lowest perplexity). ``lost`` lists the
    candidates whose worker died (:func:`lloyal.cluster.best_of_n` only):
    they keep the tokens they had and do not compete."""

    output: Continuation
    candidates: tuple[Continuation, ...]
    best_index: int
    decode_calls: int
    seconds: float
    lost: tuple[int, ...] = ()


async def best_of_n(
    ctx: Context,
    prompt: Prompt,
    n: int = 4,
    *,
    max_tokens: int = 64,
    params: SamplingParams | None = None,
    seed: int = 0,
    stop: Iterable[int] = (),
    progress: Progress | None = None,
) -> BestOfN:
    """Sample ``n`` continuations in lockstep and keep the least perplexed.

    The prompt is prefilled once into a root branch; ``n`` forks share its
    KV cells, get their own random streams (seeds ``seed .. seed+n-1``) and
    advance together, one ``llama_decode`` per step for all of them
    (:meth:`BranchStore.commit`). The winner has the lowest perplexity
    under the model's raw distribution; candidates that produced no token
    have ``inf``. Needs ``n + 1`` free KV leases (``n_seq_max``).

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import best_of_n
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         return await best_of_n(ctx, "Once upon a time", n=3, max_tokens=4)
    >>> result = asyncio.run(main())
    >>> len(result.candidates), result.decode_calls    # prefill + 3 lockstep steps
    (3, 4)
    >>> result.perplexity == min(c.perplexity for c in result.candidates)
    True
    """
    _check_positive(n=n, max_tokens=max_tokens)
    params = params or SamplingParams(temperature=0.8)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    store = BranchStore(ctx)
    _need_leases(store, ctx, n + 1, f"best_of_n(n={n})")
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    recs = [_Recorder() for _ in range(n)]
    root = Branch.create(ctx, params=params)
    try:
        await root.prefill(tokens)
        branches = [await root.fork() for _ in range(n)]
        for i, b in enumerate(branches):
            b.reseed_sampler(seed + i)
        live = list(range(n))
        for step in range(max_tokens):
            items: list[tuple[Branch, int]] = []
            for i in live:
                b = branches[i]
                p = await b.produce()
                if p.is_stop or is_stop(p.token):
                    recs[i].stopped = True
                    continue
                recs[i].add(p.token, b.model_surprisal(p.token), b.model_entropy())
                items.append((b, p.token))
            live = [i for i in live if not recs[i].stopped]
            # The last step's tokens are recorded but need no decode.
            if items and step + 1 < max_tokens:
                await store.commit(items)
            if progress is not None:
                progress(step + 1, max_tokens)
            if not live:
                break
    finally:
        await _prune_all(root)
    candidates = tuple([await r.finish(ctx) for r in recs])
    best = min(range(n), key=lambda i: (candidates[i].perplexity, i))
    return BestOfN(
        candidates[best],
        candidates,
        best,
        ctx.stats.decode_calls - calls,
        time.perf_counter() - started,
    )
