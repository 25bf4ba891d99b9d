"""The client side: a pool of Ray actors, each one context, and branches on them."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from lloyal import errors
from lloyal.branch import Produced, Token
from lloyal.cluster._worker import ContextWorker
from lloyal.errors import LloyalError, WorkerLostError
from lloyal.sampling import SamplingParams

__all__ = ["ContextPool", "RemoteBranch", "Worker"]

_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass
class _Pending:
    commits: list[tuple[int, int, asyncio.Future[dict[str, Any]]]] = field(default_factory=list)
    produces: list[tuple[int, asyncio.Future[Any]]] = field(default_factory=list)


class Worker:
    """One actor of the pool: its handle, and the step calls it coalesces.

    Calls from many tasks made in one event-loop tick (``commit`` and
    ``produce`` of many branches) go to the actor as one ``step``: one Ray
    round trip, and one decode for all the commits.
    """

    def __init__(self, pool: ContextPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.handle: Any = None
        self.pid = 0
        self.vocab = 0
        self.generation = 0
        self._pending = _Pending()
        self._flush: asyncio.Task[None] | None = None
        self.round_trips = 0

    async def start(self) -> None:
        actor = ray.remote(ContextWorker).options(num_cpus=0, max_concurrency=1000)
        self.handle = actor.remote(
            self.pool.model_path, self.pool.options, self.pool.cache_branches
        )
        info = await self.handle.start.remote()
        self.pid = int(info["pid"])
        self.vocab = int(info["vocab"])
        self.generation += 1

    async def call(self, method: str, *args: Any) -> Any:
        """``method`` on the actor; a dead actor is a WorkerLostError (and
        the pool starts a replacement)."""
        generation = self.generation
        try:
            self.round_trips += 1
            return await getattr(self.handle, method).remote(*args)
        except _LOST as e:
            await self.pool._replace(self, generation)
            raise WorkerLostError(f"worker {self.index} died: {type(e).__name__}") from None
        except RayTaskError as e:
            # The worker raised (bad input, a full cache): the same
            # exception here, not Ray's wrapper.
            if isinstance(e.cause, Exception):
                raise e.cause from None
            raise

    def _schedule(self) -> None:
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        await asyncio.sleep(0)  # let every task of this tick queue its call
        batch, self._pending = self._pending, _Pending()
        commits = [(bid, tok) for bid, tok, _ in batch.commits]
        produces = [bid for bid, _ in batch.produces]
        futures = [f for *_, f in batch.commits] + [f for _, f in batch.produces]
        try:
            done, made = await self.call("step", commits, produces)
        except BaseException as e:
            for f in futures:
                if not f.done():
                    f.set_exception(e if isinstance(e, Exception) else WorkerLostError(str(e)))
            if not isinstance(e, Exception):
                raise
            return
        for (_, _, f), result in zip(batch.commits, done, strict=True):
            _settle(f, result)
        for (_, f), result in zip(batch.produces, made, strict=True):
            _settle(f, result)

    def commit(self, bid: int, token: int) -> asyncio.Future[dict[str, Any]]:
        # Checked here: a bad token in a coalesced step would fail the
        # other branches' commits with it.
        if not 0 <= token < self.vocab:
            raise ValueError(f"token {token} is not in the vocabulary (0..{self.vocab - 1})")
        f: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending.commits.append((bid, token, f))
        self._schedule()
        return f

    def produce(self, bid: int) -> asyncio.Future[Any]:
        f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.produces.append((bid, f))
        self._schedule()
        return f


def _settle(f: asyncio.Future[Any], result: Any) -> None:
    if f.done():
        return
    if isinstance(result, str):
        f.set_exception(_error(result))
    else:
        f.set_result(result)


def _error(message: str) -> LloyalError:
    """The worker's "KVCacheFullError: ..." as that lloyal exception."""
    name, _, rest = message.partition(": ")
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, LloyalError):
        return kind(rest)
    return LloyalError(message)


class RemoteBranch:
    """A branch on one of the pool's workers, with the local Branch's
    decoding surface: ``produce``, ``commit``, ``fork``, ``prune``,
    ``async for``, ``position``, ``perplexity``; plus :meth:`migrate`."""

    def __init__(self, worker: Worker, bid: int, info: dict[str, Any], decoded: int = 0) -> None:
        self.worker = worker
        self.decoded = decoded
        """Tokens the worker decoded to create this branch (the rest of the
        prompt came from its prefix cache)."""
        self._bid = bid
        self._generation = worker.generation
        self._info = info
        self.last_surprisal = 0.0
        self.last_entropy = 0.0
        self._pruned = False

    def _check(self) -> None:
        if self._pruned:
            raise LloyalError("the remote branch was pruned")
        if self._generation != self.worker.generation:
            raise WorkerLostError(f"worker {self.worker.index} was lost with this branch")

    @property
    def position(self) -> int:
        return int(self._info["position"])

    @property
    def perplexity(self) -> float:
        """Perplexity of the tokens committed on this worker (a migrated
        branch starts counting again on its new worker)."""
        return float(self._info["perplexity"])

    async def produce(self) -> Produced:
        """The next token (nothing written); its surprisal and the
        distribution's entropy land in ``last_surprisal`` / ``last_entropy``."""
        self._check()
        token, text, stop, surprisal, entropy = await self.worker.produce(self._bid)
        self.last_surprisal, self.last_entropy = surprisal, entropy
        return Produced(token, text, stop)

    async def commit(self, token: int) -> None:
        self._check()
        self._info = await self.worker.commit(self._bid, int(token))

    async def step(self, token: int) -> Produced:
        """:meth:`commit` ``token`` and :meth:`produce` the next one, in one
        round trip (the worker commits first, as two calls would)."""
        self._check()
        both = await asyncio.gather(
            self.worker.commit(self._bid, int(token)),
            self.worker.produce(self._bid),
            return_exceptions=True,
        )
        for outcome in both:
            if isinstance(outcome, BaseException):
                raise outcome
        self._info = both[0]
        token, text, stop, surprisal, entropy = both[1]
        self.last_surprisal, self.last_entropy = surprisal, entropy
        return Produced(token, text, stop)

    async def fork(self, *, seed: int | None = None) -> RemoteBranch:
        """A child on the same worker (it shares this branch's KV prefix)."""
        return (await self.fork_many([seed]))[0]

    async def fork_many(self, seeds: Sequence[int | None]) -> list[RemoteBranch]:
        """Several children in one round trip, each reseeded if given a seed."""
        self._check()
        made = await self.worker.call("fork", self._bid, list(seeds))
        return [RemoteBranch(self.worker, bid, info) for bid, info in made]

    async def prune(self) -> None:
        if self._pruned:
            return
        self._pruned = True
        if self._generation == self.worker.generation:
            await self.worker.call("prune", [self._bid])

    async def migrate(self, worker: Worker) -> None:
        """Move this branch to ``worker`` by its state bytes (KV cells,
        logits, sampler stream): it continues there exactly as it would
        have here. Its old lease is freed."""
        self._check()
        if worker is self.worker:
            return
        state, sampler, params = await self.worker.call("export", self._bid)
        bid, info = await worker.call("adopt", state, sampler, params)
        await self.worker.call("prune", [self._bid])
        self.worker, self._bid, self._generation, self._info = (
            worker,
            bid,
            worker.generation,
            info,
        )

    async def __aiter__(self) -> AsyncIterator[Token]:
        """Produce and commit until a stop token (texts are per token). Two
        round trips per token, so that leaving the loop leaves the sampler
        where a local branch's would be; loops that go on use :meth:`step`."""
        while True:
            p = await self.produce()
            if p.is_stop:
                return
            await self.commit(p.token)
            yield Token(p.token, p.text)

    def __repr__(self) -> str:
        return f"<RemoteBranch worker={self.worker.index} position={self.position}>"


class ContextPool:
    """Ray actors, each owning one lloyal context made from the same model
    and options; branches placed on them by prefix and load.

    ``await ContextPool.start(model_path, workers=2, n_seq_max=8)`` (a Ray
    cluster must be running or startable: ``ray.init()``). See
    ``docs/cluster.md``.
    """

    def __init__(
        self, model_path: str | os.PathLike[str], options: dict[str, Any], cache_branches: int
    ) -> None:
        self.model_path = str(model_path)
        self.options = options
        self.cache_branches = cache_branches
        self.workers: list[Worker] = []
        self.replaced = 0

    @classmethod
    async def start(
        cls,
        model_path: str | os.PathLike[str],
        *,
        workers: int = 2,
        cache_branches: int = 4,
        **options: Any,
    ) -> ContextPool:
        """A pool of ``workers`` actors; ``options`` go to
        :func:`lloyal.create_context` in each."""
        if workers < 1:
            raise ValueError("workers must be at least 1")
        pool = cls(model_path, options, cache_branches)
        pool.workers = [Worker(pool, i) for i in range(workers)]
        await asyncio.gather(*(w.start() for w in pool.workers))
        return pool

    async def _replace(self, worker: Worker, generation: int) -> None:
        """Start a new actor for a dead one (once per death)."""
        if worker.generation != generation:
            return
        worker.generation += 1  # branches of the old actor now fail fast
        self.replaced += 1
        with contextlib.suppress(Exception):
            ray.kill(worker.handle)
        await worker.start()

    async def place(self, tokens: Sequence[int]) -> Worker:
        """The worker holding the longest cached prefix of ``tokens``, else
        the one with the most free leases."""
        ids = [int(t) for t in tokens]
        matches = await asyncio.gather(*(w.call("match", ids) for w in self.workers))
        best = max(range(len(self.workers)), key=lambda i: matches[i])
        if matches[best] > 0:
            return self.workers[best]
        loads = await asyncio.gather(*(w.call("load") for w in self.workers))
        return self.workers[max(range(len(loads)), key=lambda i: loads[i]["free"])]

    async def branch(
        self,
        tokens: Sequence[int],
        *,
        params: SamplingParams | None = None,
        seed: int | None = None,
        worker: Worker | None = None,
    ) -> RemoteBranch:
        """A branch holding ``tokens`` on ``worker`` or the placed one
        (:meth:`place`); only what that worker has not cached is decoded."""
        target = worker if worker is not None else await self.place(tokens)
        bid, info, decoded = await target.call("create", [int(t) for t in tokens], params, seed)
        return RemoteBranch(target, bid, info, decoded)

    async def aclose(self) -> None:
        for w in self.workers:
            with contextlib.suppress(*_LOST):
                await w.handle.close.remote()
            ray.kill(w.handle)
