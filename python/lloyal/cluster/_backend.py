"""The pool as a strategy backend: :mod:`lloyal.strategies`' own
functions run over a :class:`ContextPool`, their lanes being
:class:`RemoteBranch` es on the workers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import anyio

from lloyal._tasks import gather
from lloyal.cluster._pool import ContextPool, PoolWorker, RemoteBranch
from lloyal.errors import WorkerLostError
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import Prompt
from lloyal.strategies._lanes import Lane, register

__all__ = ["PoolBackend"]


class PoolBackend:
    """A :class:`ContextPool` as a strategy backend
    (:class:`lloyal.strategies._lanes.Backend`): tokenizer calls go to any
    live worker (they all load the same model), roots through each
    worker's prefix cache, and the decode count sums the workers'.

    Registered for :class:`ContextPool`, so that :func:`lloyal.strategies.
    beam_search` and the others take a pool where they take a context:

    >>> import asyncio, ray
    >>> from lloyal.cluster import ContextPool, beam_search, mcts
    >>> async def main():
    ...     pool = await ContextPool.start(MODEL, workers=2, n_seq_max=8, n_threads=1)
    ...     try:
    ...         beams = await beam_search(pool, "The capital of France is", width=2, max_tokens=1)
    ...         tree = await mcts(pool, "My favourite colour is", lambda text: -len(text),
    ...                           iterations=4, width=2, rollout_tokens=3, parallel=2)
    ...         return beams, tree
    ...     finally:
    ...         await pool.aclose()
    >>> ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # doctest: +ELLIPSIS
    RayContext(...)
    >>> beams, tree = asyncio.run(main())
    >>> ray.shutdown()
    >>> beams.text, len(beams.beams)
    (' Paris', 2)
    >>> tree.iterations, tree.score == -len(tree.text), tree.lost
    (4, True, 0)
    """

    def __init__(self, pool: ContextPool) -> None:
        self.pool = pool
        # A root's twins (the prompt on each other worker a search uses),
        # until its first children are placed.
        self._twins: dict[Lane, dict[PoolWorker, Lane]] = {}

    @property
    def workers(self) -> list[PoolWorker]:
        return list(self.pool.workers)

    async def tokens(self, prompt: Prompt) -> list[int]:
        tokens: list[int] = (
            await self._any_worker("tokenize", prompt)
            if isinstance(prompt, str)
            else [int(t) for t in prompt]
        )
        if not tokens:
            raise ValueError("the prompt is empty")
        return tokens

    async def need_leases(self, n: int, what: str) -> None:
        # A branch spills over to another worker when its own runs out.
        loads = await self.pool._loads()
        free = sum(load["free"] for _, load in loads)
        if free < n:
            raise ValueError(
                f"{what} needs {n} free KV leases but the pool's {len(loads)} live workers "
                f"have {free}: start the pool with more workers or a larger n_seq_max"
            )

    async def decodes(self) -> int:
        """Decodes of all workers (a replaced worker counts from its restart)."""
        stats = await gather(*(w.call("stats") for w in self.pool.workers))
        return sum(s["decode_calls"] for s in stats if isinstance(s, dict))

    async def roots(
        self, tokens: list[int], params: SamplingParams, workers: Sequence[Any]
    ) -> list[Lane]:
        made = await gather(*(self.pool.branch(tokens, params=params, worker=w) for w in workers))
        roots = [b for b in made if isinstance(b, RemoteBranch)]
        for outcome in made:
            if isinstance(outcome, BaseException):
                await self.release(roots)
                raise outcome
        if roots:
            self._twins[roots[0]] = {r.worker: r for r in roots[1:]}
        return list(roots)

    async def place(self, tokens: list[int]) -> PoolWorker:
        return await self.pool.place(tokens)

    async def children(
        self, lanes: Sequence[Lane], parents: Sequence[int], *, workers: Sequence[Any], share: int
    ) -> tuple[list[Lane | BaseException], int]:
        """A child past its parent's worker's ``share`` is made on the
        worker with the fewest children, from the parent's state bytes (or
        from the parent's twin there: the prompt each worker decoded)."""
        spares = [self._twins.pop(lane, {}) for lane in lanes]
        plan = _plan(lanes, spares, parents, workers, share)
        kept = {x for how, x in plan if how == "keep"}
        given = set(lanes).union(*(s.values() for s in spares))
        await gather(*(lane.prune() for lane in given - kept))
        made = await _make(plan)
        return made, sum(1 for how, _ in plan if how == "copy")

    async def detokenize(self, tokens: list[int]) -> str:
        text: str = await self._any_worker("detokenize", tokens)
        return text

    async def token_texts(self, tokens: list[int]) -> list[str]:
        texts: list[str] = await self._any_worker("token_texts", tokens)
        return texts

    def deferred(self) -> int:
        return 0

    async def release(self, lanes: Iterable[Lane]) -> None:
        with anyio.CancelScope(shield=True):
            await gather(*(lane.prune() for lane in lanes))

    async def _any_worker(self, method: str, *args: Any) -> Any:
        """``method`` on the first worker that is alive."""
        for w in self.pool.workers:
            try:
                return await w.call(method, *args)
            except WorkerLostError:
                continue
        raise WorkerLostError(f"no worker is left to {method}")


def _plan(
    lanes: Sequence[Lane],
    spares: list[dict[PoolWorker, Lane]],
    parents: Sequence[int],
    used: Sequence[Any],
    share: int,
) -> list[tuple[str, Any]]:
    """Where each child (of ``lanes[parents[i]]``) goes: ``("keep", lane)``
    continues the parent's own lane (its first child) or a spare in the
    same state; ``("fork", i)`` forks child ``i``'s lane, on the same
    worker, before it moves; ``("copy", (lane, worker))`` copies the
    parent's lane there by its state bytes. A worker takes children up to
    its ``share``; the rest go to the worker with the fewest."""
    count: dict[Any, int] = dict.fromkeys(used, 0)
    plan: list[tuple[str, Any]] = [("", None)] * len(parents)
    there: dict[tuple[int, Any], int] = {}  # a child holding the parent's state
    for ci, bi in enumerate(parents):
        if parents.index(bi) == ci:
            lane = lanes[bi]
            plan[ci] = ("keep", lane)
            count[lane.worker] = count.get(lane.worker, 0) + 1
            there[(bi, lane.worker)] = ci
    for ci, bi in enumerate(parents):
        if plan[ci][0]:
            continue
        home = lanes[bi].worker
        if count.get(home, 0) < share:
            target = home
        else:
            target = min(used, key=lambda w: (count[w], list(used).index(w)))
        count[target] = count.get(target, 0) + 1
        if target in spares[bi]:
            plan[ci] = ("keep", spares[bi].pop(target))
            there[(bi, target)] = ci
        elif (bi, target) in there:
            plan[ci] = ("fork", there[(bi, target)])
        else:
            plan[ci] = ("copy", (lanes[bi], target))
            there[(bi, target)] = ci
    return plan


async def _make(plan: list[tuple[str, Any]]) -> list[Lane | BaseException]:
    """The lanes of a :func:`_plan`: copies (one export per parent), then
    forks (one round trip per lane forked). A failure stands in the place
    of each lane it cost."""
    out: list[Lane | BaseException | None] = [x if how == "keep" else None for how, x in plan]
    copies: dict[Lane, list[int]] = {}
    forks: dict[int, list[int]] = {}
    for ci, (how, x) in enumerate(plan):
        if how == "copy":
            copies.setdefault(x[0], []).append(ci)
        elif how == "fork":
            forks.setdefault(x, []).append(ci)

    async def copy(source: Lane, cis: list[int]) -> None:
        made: Sequence[Any]
        try:
            targets = [plan[ci][1][1] for ci in cis]
            made = await source.copies(targets, [None] * len(cis), elsewhere=True)
        except Exception as e:
            made = [e] * len(cis)
        for ci, b in zip(cis, made, strict=True):
            out[ci] = b

    async def fork(source: int, cis: list[int]) -> None:
        parent = out[source]
        made: Sequence[Any]
        try:
            if isinstance(parent, BaseException):
                raise parent
            assert parent is not None
            made = await parent.fork_many([None] * len(cis))
        except Exception as e:
            made = [e] * len(cis)
        for ci, b in zip(cis, made, strict=True):
            out[ci] = b

    await gather(*(copy(s, cis) for s, cis in copies.items()))
    await gather(*(fork(s, cis) for s, cis in forks.items()))
    made = [b for b in out if b is not None]
    assert len(made) == len(plan), "every planned lane is made or failed"
    return made


register(ContextPool, PoolBackend)
