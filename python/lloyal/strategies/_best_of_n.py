""":func:`best_of_n`: N samples in lockstep, the least perplexed wins."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from lloyal._tasks import gather
from lloyal.context import Context
from lloyal.errors import WorkerLostError
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    _check_positive,
    _Output,
    _Recorder,
)
from lloyal.strategies._lanes import Backend, Lane, Pool, backend_of, begin, record


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
    ctx: Context | Pool,
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

    On a :class:`lloyal.cluster.ContextPool` the candidates are dealt
    round robin over the workers: each decodes the prompt once (through its
    prefix cache) and forks its own candidates, seeded as here, so on
    contexts created with ``deterministic=True`` the result is this one.
    Each step is one round trip and one decode per worker; ``decode_calls``
    counts all workers'. Candidates whose worker dies are listed in
    ``lost`` and the rest go on; only when every candidate is lost is it a
    :class:`~lloyal.WorkerLostError`. It needs ``n`` leases plus one per
    worker used.

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
    return await _best_of_n(backend_of(ctx), prompt, n, max_tokens, params, seed, stop, progress)


async def _best_of_n(
    backend: Backend,
    prompt: Prompt,
    n: int,
    max_tokens: int,
    params: SamplingParams | None,
    seed: int,
    stop: Iterable[int],
    progress: Progress | None,
) -> BestOfN:
    """:func:`best_of_n` on any backend: the candidates are dealt round
    robin over its workers (each forks its own from the prompt there), and
    a candidate whose worker dies is listed in ``lost``."""
    _check_positive(n=n, max_tokens=max_tokens)
    params = params or SamplingParams(temperature=0.8)
    tokens, extra, before, started = await begin(backend, prompt, stop)
    used = backend.workers[: min(n, len(backend.workers))]
    await backend.need_leases(n + len(used), f"best_of_n(n={n})")
    roots: list[Lane] = []
    branches: list[Lane | None] = [None] * n
    try:
        roots = await backend.roots(tokens, params, used)
        for w, root in enumerate(roots):
            mine = list(range(w, n, len(used)))
            children = await root.fork_many([seed + i for i in mine])
            for i, child in zip(mine, children, strict=True):
                branches[i] = child
        recs = [_Recorder() for _ in range(n)]
        lost: list[int] = []
        live = list(range(n))
        made = await gather(*(_lane(branches, i).produce() for i in live))
        for step in range(max_tokens):
            going = []
            for i, p in zip(live, made, strict=True):
                if isinstance(p, WorkerLostError):  # its worker died: go on without it
                    lost.append(i)
                    continue
                if isinstance(p, BaseException):
                    raise p
                if record(recs[i], p, _lane(branches, i), extra):
                    going.append(i)
            live = going
            if progress is not None:
                progress(step + 1, max_tokens)
            if not live or step + 1 == max_tokens:
                break
            # Commit this step's tokens and produce the next ones: one
            # decode (per worker) for all of them.
            made = await gather(*(_lane(branches, i).step(recs[i].tokens[-1]) for i in live))
    finally:
        await backend.release([b for b in [*branches, *roots] if b is not None])
    if len(lost) == n:
        raise WorkerLostError("every worker holding a candidate died")
    candidates = tuple([await r.finish(backend) for r in recs])
    kept = [i for i in range(n) if i not in lost]
    best = min(kept, key=lambda i: (candidates[i].perplexity, i))
    return BestOfN(
        candidates[best],
        candidates,
        best,
        max(0, await backend.decodes() - before),
        time.perf_counter() - started,
        tuple(sorted(lost)),
    )


def _lane(lanes: list[Lane | None], i: int) -> Lane:
    lane = lanes[i]
    assert lane is not None
    return lane
