"""The client side: a pool of Ray actors, each one context, and branches on them."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from lloyal._generation import Generation
from lloyal.branch import Produced, Token
from lloyal.cluster._calls import Item, Pending, quiet, settle
from lloyal.cluster._worker import ContextWorker
from lloyal.errors import KVCacheFullError, LloyalError, NoLeaseError, WorkerLostError
from lloyal.sampling import SamplingParams

__all__ = ["ContextPool", "PoolWorker", "RemoteBranch"]

_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


class PoolWorker:
    """One actor of the pool: its handle, and the step calls it coalesces.

    Calls from many tasks made in one event-loop tick (``prune``,
    ``commit``, ``produce`` and ``top_logprobs`` of many branches) go to the
    actor as one ``step``: one Ray round trip, and one decode for all the
    commits. ``round_trips`` counts the calls made to the actor.
    """

    def __init__(self, pool: ContextPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.handle: Any = None
        self.pid = 0
        self.vocab = 0
        self.generation = 0
        self._pending = Pending()
        self._flush: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self.round_trips = 0

    async def start(self) -> None:
        """Start the actor and its context; calls made meanwhile wait."""
        self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        actor = ray.remote(ContextWorker).options(num_cpus=0, max_concurrency=1000)
        self.handle = actor.remote(
            self.pool.model_path, self.pool.options, self.pool.cache_branches
        )
        try:
            info = await self.handle.start.remote()
        except RayTaskError as e:
            # The context could not be made there (a bad path or option):
            # the same exception as create_context's, not Ray's wrapper.
            if isinstance(e.cause, Exception):
                raise e.cause from None
            raise
        self.pid = int(info["pid"])
        self.vocab = int(info["vocab"])
        self.generation += 1

    async def call(self, method: str, *args: Any) -> Any:
        """``method`` on the actor; a dead actor is a WorkerLostError (and
        the pool starts a replacement)."""
        starting = self._starting
        if starting is not None:
            if not starting.done():
                await asyncio.wait([starting])  # a replacement is on its way
            if starting.cancelled() or starting.exception() is not None:
                raise WorkerLostError(f"worker {self.index} could not be started again")
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

    async def make(self, method: str, *args: Any) -> Any:
        """A call that creates branches (``create``, ``fork``, ``adopt``).
        The actor goes on with it when the caller is cancelled, so then
        what it made is pruned as soon as it returns."""
        task = asyncio.ensure_future(self.call(method, *args))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._orphaned(method, t))
            raise

    def _orphaned(self, method: str, task: asyncio.Future[Any]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        made = task.result()
        bids = [m[0] for m in made if m is not None] if method == "fork" else [made[0]]
        for bid in bids:
            self.prune(bid).add_done_callback(quiet)

    def _schedule(self) -> None:
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        """Send what is pending as one step; what queues up while a step
        is on the wire goes in the next one, sent as soon as it returns
        (one step in flight per actor keeps each branch's calls in order)."""
        await asyncio.sleep(0)  # let every task of this tick queue its call
        while not self._pending.empty():
            batch, self._pending = self._pending, Pending()
            for f in batch.drop_stale(self.generation):
                if not f.done():
                    f.set_exception(WorkerLostError(f"worker {self.index} was lost"))
            if batch.empty():
                continue
            try:
                done, made, top = await self.call(
                    "step",
                    [args[0] for args, _, _ in batch.prunes],
                    [args for args, _, _ in batch.commits],
                    [args[0] for args, _, _ in batch.produces],
                    [args for args, _, _ in batch.tops],
                )
            except BaseException as e:
                error = e if isinstance(e, Exception) else WorkerLostError(str(e))
                for f in batch.futures():
                    if not f.done():
                        f.set_exception(error)
                if not isinstance(e, Exception):
                    for f in self._pending.futures():  # nobody is left to send them
                        if not f.done():
                            f.set_exception(error)
                    self._pending = Pending()
                    raise
                continue
            for _, _, f in batch.prunes:
                settle(f, None)
            for results, queue in (
                (done, batch.commits),
                (made, batch.produces),
                (top, batch.tops),
            ):
                for (_, _, f), result in zip(queue, results, strict=True):
                    settle(f, result)

    def _queue(self, queue: list[Item], *args: Any) -> asyncio.Future[Any]:
        f: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue.append((args, self.generation, f))
        self._schedule()
        return f

    def commit(self, bid: int, token: int) -> asyncio.Future[dict[str, Any]]:
        # Checked here: a bad token in a coalesced step would fail the
        # other branches' commits with it.
        if not 0 <= token < self.vocab:
            raise ValueError(f"token {token} is not in the vocabulary (0..{self.vocab - 1})")
        return self._queue(self._pending.commits, bid, token)

    def produce(self, bid: int) -> asyncio.Future[Any]:
        return self._queue(self._pending.produces, bid)

    def top(self, bid: int, k: int) -> asyncio.Future[Any]:
        return self._queue(self._pending.tops, bid, k)

    def prune(self, bid: int) -> asyncio.Future[Any]:
        return self._queue(self._pending.prunes, bid)

    async def load(self) -> dict[str, int]:
        """Branches held, leases free and KV cells free on the actor."""
        load: dict[str, int] = await self.call("load")
        return load


class RemoteBranch:
    """A branch on one of the pool's workers, with the local Branch's
    decoding surface: ``produce``, ``commit``, ``fork``, ``prune``,
    ``top_logprobs``, ``async for``, ``position``, ``perplexity``; plus
    :meth:`step` (commit and produce in one round trip) and :meth:`migrate`.

    A branch moves by itself when its worker runs out of room: a fork the
    worker has no KV lease for is made on the worker with the most free
    leases, and a commit its KV cache has no cells for moves the branch to
    the worker with the most free cells and commits there (both by the
    state bytes, so the tokens and the random stream go on exactly).
    """

    def __init__(
        self, worker: PoolWorker, bid: int, info: dict[str, Any], decoded: int = 0
    ) -> None:
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
        """Write ``token``: one decode, shared with every commit queued on
        the worker in the same tick."""
        await self.advance(token)

    async def step(self, token: int) -> Produced:
        """:meth:`commit` ``token`` and :meth:`produce` the next one, in one
        round trip (the worker commits first, as two calls would)."""
        produced, _ = await self.advance(token, produce=True)
        assert produced is not None
        return produced

    async def top_logprobs(self, k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float64]]:
        """As :meth:`lloyal.Branch.top_logprobs`: the ``k`` most likely next
        tokens and their log-probabilities (nats, the raw distribution).
        The distribution's entropy lands in ``last_entropy``."""
        tokens, logprobs, _, _ = await self.candidates(k)
        return np.asarray(tokens, dtype=np.int32), np.asarray(logprobs, dtype=np.float64)

    async def candidates(self, k: int) -> tuple[list[int], list[float], float, list[bool]]:
        """The top-``k`` as plain lists, with the entropy and stop flags."""
        self._check()
        tokens, logprobs, entropy, stops = await self.worker.top(self._bid, int(k))
        self.last_entropy = entropy
        return tokens, logprobs, entropy, stops

    async def advance(
        self, token: int, *, produce: bool = False, top: int = 0
    ) -> tuple[Produced | None, Any]:
        """Commit ``token`` and, in the same round trip, produce and/or take
        the top-``top`` (raw: tokens, logprobs, entropy, stop flags). A
        commit the KV cache has no room for moves the branch to a worker
        with more free cells, once, and is made there."""
        self._check()
        token = int(token)
        results: list[Any] = []
        for attempt in range(2):
            w, bid = self.worker, self._bid
            calls: list[asyncio.Future[Any]] = [w.commit(bid, token)]
            if produce:
                calls.append(w.produce(bid))
            if top:
                calls.append(w.top(bid, top))
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            if isinstance(outcomes[0], KVCacheFullError) and attempt == 0 and await self._relieve():
                continue
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
                results.append(outcome)
            break
        self._info = results[0]
        produced = None
        if produce:
            t, text, stop, surprisal, entropy = results[1]
            self.last_surprisal, self.last_entropy = surprisal, entropy
            produced = Produced(t, text, stop)
        return produced, results[-1] if top else None

    async def _relieve(self) -> bool:
        """Move to the live worker with the most free KV cells, if it has
        room for this branch's sequence; whether it moved."""
        loads = await self.worker.pool._loads()
        others = [(w, load) for w, load in loads if w is not self.worker]
        if not others:
            return False
        target, load = max(others, key=lambda wl: wl[1]["cells_free"])
        if load["cells_free"] <= self.position or load["free"] < 1:
            return False
        try:
            await self.migrate(target)
        except NoLeaseError:  # taken since: the commit's own error stands
            return False
        return True

    async def fork(
        self, *, seed: int | None = None, worker: PoolWorker | None = None
    ) -> RemoteBranch:
        """A child, reseeded if given a seed. It is made on this branch's
        worker (sharing its KV prefix), or on ``worker`` by the state bytes."""
        if worker is not None and worker is not self.worker:
            self._check()
            return (await self.copies([worker], [seed]))[0]
        return (await self.fork_many([seed]))[0]

    async def fork_many(self, seeds: Sequence[int | None]) -> list[RemoteBranch]:
        """Several children in one round trip, each reseeded if given a
        seed. Those the worker has no lease for are made on the workers
        with the most free leases (:class:`NoLeaseError` if none has one)."""
        self._check()
        made = await self.worker.make("fork", self._bid, list(seeds))
        out = [None if m is None else RemoteBranch(self.worker, m[0], m[1]) for m in made]
        missing = [i for i, m in enumerate(out) if m is None]
        if missing:
            try:
                targets = await self.worker.pool._spread(len(missing), avoid=self.worker)
                spilled = await self.copies(targets, [seeds[i] for i in missing], elsewhere=True)
            except BaseException:
                await asyncio.gather(*(b.prune() for b in out if b is not None))
                raise
            for i, b in zip(missing, spilled, strict=True):
                out[i] = b
        return [b for b in out if b is not None]

    async def copies(
        self, workers: Sequence[PoolWorker], seeds: Sequence[int | None], *, elsewhere: bool = False
    ) -> list[RemoteBranch]:
        """Copies of this branch on ``workers`` by its state bytes (one
        export, one adopt per copy). With ``elsewhere``, a copy whose worker
        has no lease left (others may have taken it since the choice) is
        made on another that has one. All copies are made, or none."""
        state, sampler, params = await self.worker.call("export", self._bid)
        pool = self.worker.pool

        async def adopt(w: PoolWorker, seed: int | None) -> RemoteBranch:
            tried = {w}
            while True:
                try:
                    bid, info = await w.make("adopt", state, sampler, params, seed)
                    return RemoteBranch(w, bid, info)
                except NoLeaseError:
                    if not elsewhere:
                        raise
                    loads = await pool._loads()
                    free = [(ld["free"], -x.index) for x, ld in loads if x not in tried]
                    if not free or max(free)[0] < 1:
                        raise
                    w = pool.workers[-max(free)[1]]
                    tried.add(w)

        pairs = zip(workers, seeds, strict=True)
        made = await asyncio.gather(*(adopt(w, s) for w, s in pairs), return_exceptions=True)
        copies = [m for m in made if isinstance(m, RemoteBranch)]
        pool.migrations += len(copies)
        for m in made:
            if isinstance(m, BaseException):
                await asyncio.gather(*(c.prune() for c in copies), return_exceptions=True)
                raise m
        return copies

    async def prune(self) -> None:
        """Free this branch's lease (queued with the worker's next step)."""
        if self._pruned:
            return
        self._pruned = True
        if self._generation == self.worker.generation:
            await self.worker.prune(self._bid)

    async def migrate(self, worker: PoolWorker) -> None:
        """Move this branch to ``worker`` by its state bytes (KV cells,
        logits, sampler stream): it continues there exactly as it would
        have here. Its old lease is freed."""
        self._check()
        if worker is self.worker:
            return
        (copy,) = await self.copies([worker], [None])
        old, old_bid, old_generation = self.worker, self._bid, self._generation
        self.worker, self._bid, self._generation, self._info = (
            copy.worker,
            copy._bid,
            copy._generation,
            copy._info,
        )
        if old_generation == old.generation:
            with contextlib.suppress(LloyalError):  # (a dead worker frees it anyway)
                await old.prune(old_bid)

    async def __aiter__(self) -> AsyncIterator[Token]:
        """Produce and commit until a stop token (texts are per token). Two
        round trips per token, so that leaving the loop leaves the sampler
        where a local branch's would be; loops that go on use :meth:`step`."""
        async for step in Generation(None).drive(self):
            if step.token is not None:
                yield Token(step.token, step.text)

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
        self.workers: list[PoolWorker] = []
        self.replaced = 0
        """Actors started in place of dead ones."""
        self._programs: dict[PoolWorker, int] = {}  # programs running on each worker
        self.migrations = 0
        """Branches copied between workers by their state bytes: moves,
        forks made elsewhere, automatic moves when a worker ran out of room."""

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
        pool.workers = [PoolWorker(pool, i) for i in range(workers)]
        try:
            started = await asyncio.gather(
                *(w.start() for w in pool.workers), return_exceptions=True
            )
            failed = [e for e in started if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:
            # No actor outlives a pool that did not start (started ones
            # included): the caller holds nothing to close them with.
            pool._kill()
            raise
        return pool

    def _kill(self) -> None:
        """End every actor the pool made, at once."""
        for w in self.workers:
            if w.handle is not None:
                with contextlib.suppress(Exception):
                    ray.kill(w.handle)

    async def _replace(self, worker: PoolWorker, generation: int) -> None:
        """Start a new actor for a dead one (once per death)."""
        if worker.generation != generation:
            return  # another caller replaced it (calls wait for the start)
        worker.generation += 1  # branches of the old actor now fail fast
        self.replaced += 1
        with contextlib.suppress(Exception):
            ray.kill(worker.handle)
        # A failed start stays in worker._starting: calls then raise
        # WorkerLostError (as the caller here does already).
        with contextlib.suppress(Exception):
            await worker.start()

    async def _loads(self) -> list[tuple[PoolWorker, dict[str, int]]]:
        """Each live worker's :meth:`PoolWorker.load` (dead ones are left out)."""
        loads = await asyncio.gather(*(w.load() for w in self.workers), return_exceptions=True)
        out = []
        for w, load in zip(self.workers, loads, strict=True):
            if isinstance(load, WorkerLostError):
                continue
            if isinstance(load, BaseException):
                raise load
            out.append((w, load))
        return out

    async def _spread(self, n: int, *, avoid: PoolWorker | None = None) -> list[PoolWorker]:
        """Workers for ``n`` new branches, one at a time to the one with
        the most free leases, never ``avoid`` (a worker that just ran out);
        NoLeaseError if they run out."""
        loads = await self._loads()
        free = {w: load["free"] for w, load in loads if w is not avoid}
        out = []
        for _ in range(n):
            w = max(free, key=lambda w: (free[w], -w.index), default=None)
            if w is None or free[w] < 1:
                raise NoLeaseError(f"no worker of the pool has a free KV lease for {n} branches")
            free[w] -= 1
            out.append(w)
        return out

    async def place(self, tokens: Sequence[int]) -> PoolWorker:
        """Among workers with a free lease: the one holding the longest
        cached prefix of ``tokens``, else the one with the most free leases."""
        ids = [int(t) for t in tokens]
        loads = await self._loads()
        if not loads:
            raise WorkerLostError("no worker of the pool is alive")
        open_ = [(w, load) for w, load in loads if load["free"] > 0] or loads
        matches = await asyncio.gather(*(w.call("match", ids) for w, _ in open_))
        best = max(range(len(open_)), key=lambda i: (matches[i], open_[i][1]["free"]))
        return open_[best][0]

    async def branch(
        self,
        tokens: Sequence[int],
        *,
        params: SamplingParams | None = None,
        seed: int | None = None,
        worker: PoolWorker | None = None,
    ) -> RemoteBranch:
        """A branch holding ``tokens`` on ``worker`` or the placed one
        (:meth:`place`); only what that worker has not cached is decoded."""
        target = worker if worker is not None else await self.place(tokens)
        bid, info, decoded = await target.make("create", [int(t) for t in tokens], params, seed)
        return RemoteBranch(target, bid, info, decoded)

    async def available(self) -> int:
        """Free KV leases over the live workers (their prefix caches'
        entries included: they give theirs back on demand)."""
        return sum(load["free"] for _, load in await self._loads())

    async def run_program(
        self,
        prog: Any,
        *args: Any,
        params: SamplingParams | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Run a :class:`lloyal.Program` on the worker with the most free
        leases and return its finished state as plain data
        (``ProgramState.snapshot()``); ``prog.run(pool, ...)`` calls this
        and makes it a closed :class:`lloyal.ProgramState`."""
        loads = await self._loads()
        if not loads:
            raise WorkerLostError("no worker of the pool is alive")
        # Programs started here and not finished count against a worker's
        # free leases: a batch started at once spreads over the workers.
        target = max(
            (w for w, _ in loads),
            key=lambda w: (dict(loads)[w]["free"] - self._programs.get(w, 0), -w.index),
        )
        self._programs[target] = self._programs.get(target, 0) + 1
        try:
            data = await target.call("run_program", prog, args, kwargs, params, chat_template)
        finally:
            self._programs[target] -= 1
        return dict(data)

    async def aclose(self) -> None:
        for w in self.workers:
            with contextlib.suppress(*_LOST):
                await w.handle.close.remote()
            ray.kill(w.handle)
