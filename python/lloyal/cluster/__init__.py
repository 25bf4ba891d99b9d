"""lloyal past one process: a pool of Ray actors, each one context
(``pip install 'lloyal[ray]'``).

:class:`ContextPool` starts the actors; :meth:`ContextPool.branch` places a
new branch on the worker that has cached the longest prefix of its prompt
(else the least loaded) and returns a :class:`RemoteBranch` with the local
decoding surface. Calls from many tasks in one tick go to a worker as one
round trip and one decode. :meth:`RemoteBranch.migrate` moves a branch by
its state bytes, and a branch moves by itself when its worker runs out of
KV leases or cells; a worker that dies fails its branches with
:class:`lloyal.WorkerLostError` and is replaced. The strategies of
:mod:`lloyal.strategies` take a pool where they take a context
(:func:`best_of_n`, :func:`beam_search` and :func:`mcts`, re-exported
here, are the same functions): they spread a search over the pool and go
on with what survives a dead worker. See ``docs/cluster.md``.
"""

from __future__ import annotations

import warnings
from typing import Any

from lloyal.cluster._backend import PoolBackend
from lloyal.cluster._pool import ContextPool, PoolWorker, RemoteBranch
from lloyal.errors import WorkerLostError
from lloyal.strategies import beam_search, best_of_n, mcts

__all__ = [
    "ContextPool",
    "PoolBackend",
    "PoolWorker",
    "RemoteBranch",
    "WorkerLostError",
    "beam_search",
    "best_of_n",
    "mcts",
]


def __getattr__(name: str) -> Any:
    # ``Worker`` was this name's first spelling; it clashed with the
    # engine's own worker (CHANGELOG, "Moved").
    if name == "Worker":
        warnings.warn(
            "lloyal.cluster.Worker is now lloyal.cluster.PoolWorker",
            DeprecationWarning,
            stacklevel=2,
        )
        return PoolWorker
    raise AttributeError(f"module 'lloyal.cluster' has no attribute {name!r}")
