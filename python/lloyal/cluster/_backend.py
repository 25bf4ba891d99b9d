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
        return list(roots)

    async def place(self, tokens: list[int]) -> PoolWorker:
        return await self.pool.place(tokens)

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


register(ContextPool, PoolBackend)
