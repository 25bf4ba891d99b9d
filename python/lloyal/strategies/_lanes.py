"""Where a strategy's branches live: the seam that lets each strategy be
written once.

A strategy drives *lanes* (:class:`Lane`: a branch's verbs, batched into
one round trip where a remote branch needs it) that a *backend*
(:class:`Backend`: the prompt's tokens, the roots, the decode count, the
leases, the clean-up) makes. :class:`LocalBackend` runs on one
:class:`~lloyal.Context`, its lanes wrapping :class:`~lloyal.Branch`;
:mod:`lloyal.cluster` has the pool's, whose lanes are
:class:`~lloyal.cluster.RemoteBranch` es on Ray actors that may die
(``WorkerLostError``) and may be copied between workers.

Lanes of one backend used from concurrent tasks (:func:`gather`) share
decodes: the local coalescer merges one event-loop tick's commits, the
pool's workers one round trip's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from lloyal._tasks import gather
from lloyal.branch import Branch, BranchStore, Produced
from lloyal.context import Context
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import Prompt, _prompt_tokens, _prune_all, _Recorder

Top = tuple[list[int], list[float], float, list[bool]]
"""A lane's next-token candidates: tokens, log-probabilities (nats, best
first), the distribution's entropy, and which tokens are the model's stop
tokens."""


class Lane(Protocol):
    """One branch a strategy drives, wherever it lives."""

    @property
    def worker(self) -> Any:
        """Where it lives (a pool's worker; the context, locally)."""

    last_surprisal: float
    """Surprisal of the token the last :meth:`produce` / :meth:`step` chose."""

    last_entropy: float
    """Entropy of the distribution that token was chosen from."""

    async def produce(self) -> Produced: ...

    async def step(self, token: int) -> Produced:
        """Commit ``token`` and produce the next one."""
        ...

    async def candidates(self, k: int) -> Top:
        """The ``k`` most likely next tokens (:data:`Top`)."""
        ...

    async def advance(
        self, token: int, *, produce: bool = False, top: int = 0
    ) -> tuple[Produced | None, Any]:
        """Commit ``token``, then produce and/or take the top ``top``."""
        ...

    async def fork(self, *, seed: int | None = None) -> Lane: ...

    async def fork_many(self, seeds: Sequence[int | None]) -> Sequence[Lane]: ...

    async def copies(
        self, workers: Sequence[Any], seeds: Sequence[int | None], *, elsewhere: bool = False
    ) -> Sequence[Lane]:
        """Copies on other workers (a pool's lanes only)."""
        ...

    async def prune(self) -> None: ...


class Pool(Protocol):
    """A :class:`lloyal.cluster.ContextPool`, as the strategies see it (its
    backend is registered by :mod:`lloyal.cluster`)."""

    @property
    def workers(self) -> Sequence[Any]: ...


class Backend(Protocol):
    """What a strategy needs besides its lanes."""

    @property
    def workers(self) -> Sequence[Any]: ...

    async def tokens(self, prompt: Prompt) -> list[int]: ...

    async def need_leases(self, n: int, what: str) -> None:
        """``ValueError`` unless ``n`` KV leases are free."""
        ...

    async def decodes(self) -> int:
        """``llama_decode`` calls so far (all workers)."""
        ...

    async def roots(
        self, tokens: list[int], params: SamplingParams, workers: Sequence[Any]
    ) -> list[Lane]:
        """The prompt decoded on each of ``workers``: all, or none."""
        ...

    async def place(self, tokens: list[int]) -> Any:
        """The worker a search on one worker should use."""
        ...

    async def children(
        self, lanes: Sequence[Lane], parents: Sequence[int], *, workers: Sequence[Any], share: int
    ) -> tuple[list[Lane | BaseException], int]:
        """A search's next generation: child ``i`` continues
        ``lanes[parents[i]]``. A parent's first child is its own lane, the
        others forks or, on a pool, copies on another of ``workers``
        (each worker takes children up to ``share``). The lanes no child
        continues are pruned first, freeing their leases. A failure
        stands in the place of each lane it cost; the second value is how
        many lanes were copied between workers."""
        ...

    async def detokenize(self, tokens: list[int]) -> str: ...

    async def token_texts(self, tokens: list[int]) -> list[str]: ...

    def deferred(self) -> int:
        """Leases pruned lanes still hold (a branch with live forks keeps
        its lease until the last of them goes)."""
        ...

    async def release(self, lanes: Iterable[Lane]) -> None:
        """Prune ``lanes`` and everything the search left, also while the
        caller is being cancelled."""
        ...


async def begin(
    backend: Backend, prompt: Prompt, stop: Iterable[int]
) -> tuple[list[int], frozenset[int], int, float]:
    """What every search starts from: the prompt's tokens, the extra stop
    tokens, the decode count and the clock."""
    tokens = await backend.tokens(prompt)
    return tokens, frozenset(int(t) for t in stop), await backend.decodes(), time.perf_counter()


def record(rec: _Recorder, produced: Produced, lane: Lane, extra: frozenset[int]) -> bool:
    """Add ``produced`` to ``rec`` (with the lane's surprisal and entropy)
    unless it is a stop token; whether the lane goes on."""
    if produced.is_stop or produced.token in extra:
        rec.stopped = True
        return False
    rec.add(produced.token, lane.last_surprisal, lane.last_entropy)
    return True


class LocalLane:
    """A :class:`~lloyal.Branch` as a :class:`Lane`."""

    __slots__ = ("_backend", "branch", "last_entropy", "last_surprisal")

    def __init__(self, backend: LocalBackend, branch: Branch) -> None:
        self._backend = backend
        self.branch = branch
        self.last_surprisal = 0.0
        self.last_entropy = 0.0

    @property
    def worker(self) -> Context:
        return self._backend.ctx

    async def produce(self) -> Produced:
        p = await self.branch.produce()
        self.last_surprisal = self.branch.model_surprisal(p.token)
        self.last_entropy = self.branch.model_entropy()
        return p

    async def step(self, token: int) -> Produced:
        await self.branch.commit(token)
        return await self.produce()

    async def candidates(self, k: int) -> Top:
        tokens, logprobs = self.branch.top_logprobs(k)
        self.last_entropy = self.branch.model_entropy()
        ctx = self._backend.ctx
        ids = tokens.tolist()
        return ids, logprobs.tolist(), self.last_entropy, [ctx.is_stop_token(t) for t in ids]

    async def advance(
        self, token: int, *, produce: bool = False, top: int = 0
    ) -> tuple[Produced | None, Any]:
        await self.branch.commit(token)
        produced = await self.produce() if produce else None
        return produced, await self.candidates(top) if top else None

    async def fork(self, *, seed: int | None = None) -> LocalLane:
        child = await self.branch.fork()
        if seed is not None:
            child.reseed_sampler(seed)
        return LocalLane(self._backend, child)

    async def fork_many(self, seeds: Sequence[int | None]) -> list[LocalLane]:
        return [await self.fork(seed=s) for s in seeds]

    async def copies(
        self, workers: Sequence[Any], seeds: Sequence[int | None], *, elsewhere: bool = False
    ) -> list[LocalLane]:
        raise AssertionError("one context has no other worker to copy a branch to")

    async def prune(self) -> None:
        """Free the lease, or (while the branch has live forks, which share
        its cells) once the last of them is pruned."""
        branch: Branch | None = self.branch
        waiting = self._backend._waiting
        if branch is None or branch.disposed:
            return
        if not branch.is_leaf:
            waiting.add(branch)
            return
        while branch is not None and branch.is_leaf:
            parent = branch.parent
            waiting.discard(branch)
            await branch.prune()
            branch = parent if parent in waiting else None


class LocalBackend:
    """One :class:`~lloyal.Context` as a :class:`Backend`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._roots: list[Branch] = []
        self._waiting: set[Branch] = set()

    @property
    def workers(self) -> list[Context]:
        return [self.ctx]

    async def tokens(self, prompt: Prompt) -> list[int]:
        return await _prompt_tokens(self.ctx, prompt)

    async def need_leases(self, n: int, what: str) -> None:
        available = BranchStore(self.ctx).available
        if available < n:
            raise ValueError(
                f"{what} needs {n} free KV leases but {available} of the context's "
                f"n_seq_max={self.ctx.n_seq_max} are free: create the context with "
                f"n_seq_max >= {n}"
            )

    async def decodes(self) -> int:
        return self.ctx.stats.decode_calls

    async def roots(
        self, tokens: list[int], params: SamplingParams, workers: Sequence[Any]
    ) -> list[Lane]:
        root = Branch.create(self.ctx, params=params)
        self._roots.append(root)
        await root.prefill(tokens)
        return [LocalLane(self, root)]

    async def place(self, tokens: list[int]) -> Context:
        return self.ctx

    async def children(
        self, lanes: Sequence[Lane], parents: Sequence[int], *, workers: Sequence[Any], share: int
    ) -> tuple[list[Lane | BaseException], int]:
        # One worker: every further child is a fork of its parent.
        await gather(*(lane.prune() for i, lane in enumerate(lanes) if i not in parents))
        out: list[Lane | BaseException | None] = [None] * len(parents)
        forks: dict[int, list[int]] = {}
        for ci, bi in enumerate(parents):
            if parents.index(bi) == ci:
                out[ci] = lanes[bi]
            else:
                forks.setdefault(bi, []).append(ci)
        made = await gather(*(lanes[bi].fork_many([None] * len(cis)) for bi, cis in forks.items()))
        for cis, forked in zip(forks.values(), made, strict=True):
            for j, ci in enumerate(cis):
                out[ci] = forked if isinstance(forked, BaseException) else forked[j]
        assert all(x is not None for x in out), "every child is made or failed"
        return out, 0  # type: ignore[return-value]

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.ctx.detokenize(tokens)

    async def token_texts(self, tokens: list[int]) -> list[str]:
        return [self.ctx.token_to_text(t) for t in tokens]

    def deferred(self) -> int:
        return len(self._waiting)

    async def release(self, lanes: Iterable[Lane]) -> None:
        # Every lane descends from a root: pruning the roots' subtrees
        # frees them all, and the branches waiting for their forks too.
        del lanes
        for root in self._roots:
            await _prune_all(root)
        self._waiting.clear()


_BACKENDS: dict[type, Callable[[Any], Backend]] = {}


def register(kind: type, make: Callable[[Any], Backend]) -> None:
    """Let the strategies run on instances of ``kind`` (:mod:`lloyal.cluster`
    registers :class:`~lloyal.cluster.ContextPool`)."""
    _BACKENDS[kind] = make


def backend_of(target: Context | Pool) -> Backend:
    """The backend a strategy called on ``target`` runs on."""
    if isinstance(target, Context):
        return LocalBackend(target)
    for kind, make in _BACKENDS.items():
        if isinstance(target, kind):
            return make(target)
    raise TypeError(
        "a strategy runs on a lloyal.Context or a lloyal.cluster.ContextPool, "
        f"got {type(target).__name__}"
    )
