"""Strategies spread over a :class:`ContextPool`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from lloyal.cluster._pool import ContextPool, RemoteBranch
from lloyal.errors import WorkerLostError
from lloyal.sampling import SamplingParams
from lloyal.strategies import BestOfN, Continuation
from lloyal.strategies._common import Prompt, _check_positive, _Recorder

__all__ = ["best_of_n"]


async def best_of_n(
    pool: ContextPool,
    prompt: Prompt,
    n: int = 4,
    *,
    max_tokens: int = 64,
    params: SamplingParams | None = None,
    seed: int = 0,
    stop: Iterable[int] = (),
) -> BestOfN:
    """:func:`lloyal.strategies.best_of_n` with the candidates spread over
    the pool's workers, round robin: each worker decodes the prompt once
    (through its prefix cache) and forks its candidates from it. Candidate
    ``i`` is seeded ``seed + i`` as locally, so on contexts created with
    ``deterministic=True`` the result equals the local one. Each step is
    one round trip and one decode per worker for all its candidates.
    ``decode_calls`` counts the decodes of all workers. Candidates whose
    worker dies are listed in ``lost`` and the rest go on; only when every
    candidate is lost is it a :class:`WorkerLostError`."""
    _check_positive(n=n, max_tokens=max_tokens)
    params = params or SamplingParams(temperature=0.8)
    first = pool.workers[0]
    tokens = (
        await first.call("tokenize", prompt)
        if isinstance(prompt, str)
        else [int(t) for t in prompt]
    )
    if not tokens:
        raise ValueError("the prompt is empty")
    extra = frozenset(int(t) for t in stop)
    before = await _decodes(pool)
    started = time.perf_counter()
    used = pool.workers[: min(n, len(pool.workers))]
    roots = await asyncio.gather(*(pool.branch(tokens, params=params, worker=w) for w in used))
    branches: list[RemoteBranch] = [None] * n  # type: ignore[list-item]
    try:
        for w, root in enumerate(roots):
            mine = list(range(w, n, len(used)))
            children = await root.fork_many([seed + i for i in mine])
            for i, child in zip(mine, children, strict=True):
                branches[i] = child
        recs = [_Recorder() for _ in range(n)]
        lost: list[int] = []
        live = list(range(n))
        made = await asyncio.gather(*(branches[i].produce() for i in live), return_exceptions=True)
        for step in range(max_tokens):
            going = []
            for i, p in zip(live, made, strict=True):
                if isinstance(p, WorkerLostError):  # its worker died: go on without it
                    lost.append(i)
                    continue
                if isinstance(p, BaseException):
                    raise p
                if p.is_stop or p.token in extra:
                    recs[i].stopped = True
                    continue
                b = branches[i]
                recs[i].add(p.token, b.last_surprisal, b.last_entropy)
                going.append(i)
            live = going
            if not live or step + 1 == max_tokens:
                break
            # Commit this step's tokens and produce the next ones: one round
            # trip and one decode per worker.
            made = await asyncio.gather(
                *(branches[i].step(recs[i].tokens[-1]) for i in live), return_exceptions=True
            )
    finally:
        await asyncio.gather(
            *(b.prune() for b in [*branches, *roots] if b is not None), return_exceptions=True
        )
    if len(lost) == n:
        raise WorkerLostError("every worker holding a candidate died")
    texts = await asyncio.gather(*(_detokenize(pool, r.tokens) for r in recs))
    candidates = tuple(
        Continuation(text, tuple(r.tokens), tuple(r.surprisals), tuple(r.entropies), r.stopped)
        for text, r in zip(texts, recs, strict=True)
    )
    kept = [i for i in range(n) if i not in lost]
    best = min(kept, key=lambda i: (candidates[i].perplexity, i))
    return BestOfN(
        candidates[best],
        candidates,
        best,
        max(0, await _decodes(pool) - before),
        time.perf_counter() - started,
        tuple(sorted(lost)),
    )


async def _detokenize(pool: ContextPool, tokens: list[int]) -> str:
    """Text of ``tokens`` from any live worker."""
    for w in pool.workers:
        try:
            text: str = await w.call("detokenize", tokens)
            return text
        except WorkerLostError:
            continue
    raise WorkerLostError("no worker is left to detokenize")


async def _decodes(pool: ContextPool) -> int:
    """Decodes of all workers (a replaced worker counts from its restart)."""
    stats = await asyncio.gather(*(w.call("stats") for w in pool.workers), return_exceptions=True)
    return sum(s["decode_calls"] for s in stats if isinstance(s, dict))
