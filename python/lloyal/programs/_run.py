"""Running programs: one, or a batch of them sharing the context's decodes."""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO, cast

import anyio

from lloyal import _check
from lloyal._tasks import gather
from lloyal.branch import Branch, BranchStore
from lloyal.programs._state import ProgramState
from lloyal.sampling import SamplingParams

if TYPE_CHECKING:
    from lloyal.cluster import ContextPool
    from lloyal.context import Context

__all__ = ["Program", "program", "run_batch"]

ProgramFunction = Callable[..., Awaitable[Any]]


class Program:
    """An async function of a :class:`ProgramState` (made by
    :func:`program`), run on a context.

    >>> import asyncio, lloyal
    >>> @lloyal.program
    ... async def capital(s, country):
    ...     s += f"The capital of {country} is"
    ...     await s.select("city", [" Paris", " Berlin", " Madrid"])
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         state = await capital.run(ctx, "France")
    ...         return state["city"]
    >>> asyncio.run(main())
    ' Paris'
    """

    def __init__(self, fn: ProgramFunction) -> None:
        if not callable(fn):
            raise TypeError("a program is an async function taking the state first")
        self._fn = fn
        functools.update_wrapper(self, fn)

    async def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Run the function on an existing state (a program calling another)."""
        return await self._fn(s, *args, **kwargs)

    async def run(
        self,
        source: Context | Branch | ContextPool,
        /,
        *args: Any,
        params: SamplingParams | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run on a new state (see :meth:`ProgramState.open`: a new branch
        of ``source``, one KV lease, freed at the end) and return it,
        closed: its ``text``, captures and ``result`` (the function's return
        value) stay readable. ``params`` / ``chat_template``: see
        :meth:`ProgramState.open`.

        ``source`` may also be a :class:`lloyal.cluster.ContextPool`: the
        program then runs, unchanged, on the worker with the most free
        leases, next to its context (the function is sent there, so it
        must be picklable by Ray: a module-level or local function, whose
        arguments and return value are plain data)."""
        if _is_pool(source):
            data = await cast("ContextPool", source).run_program(
                self, *args, params=params, chat_template=chat_template, **kwargs
            )
            return ProgramState.from_snapshot(None, data)
        local = cast("Context | Branch", source)
        state = await ProgramState.open(local, params=params, chat_template=chat_template)
        async with state:
            state.result = await self._fn(state, *args, **kwargs)
        return state

    async def run_batch(
        self,
        ctx: Context | ContextPool,
        inputs: Sequence[Any],
        *,
        concurrency: int | None = None,
        params: SamplingParams | None = None,
        chat_template: str | None = None,
        progress: bool | TextIO | None = None,
    ) -> list[ProgramState]:
        """:func:`run_batch` of this program."""
        return await run_batch(
            self,
            ctx,
            inputs,
            concurrency=concurrency,
            params=params,
            chat_template=chat_template,
            progress=progress,
        )

    def __repr__(self) -> str:
        return f"<lloyal.Program {getattr(self._fn, '__qualname__', self._fn)!r}>"


def program(fn: ProgramFunction) -> Program:
    """Make ``async def f(s, ...)`` a :class:`Program`: ``await
    f.run(ctx, ...)`` runs it on a new :class:`ProgramState`, ``await
    f.run_batch(ctx, inputs)`` on many at once.

    >>> import asyncio, lloyal
    >>> @lloyal.program
    ... async def count(s):
    ...     s += "1, 2, 3,"
    ...     await s.gen("next", max_tokens=4, stop=",")
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         return (await count.run(ctx, params=lloyal.GREEDY))["next"]
    >>> asyncio.run(main())
    ' 4'
    """
    return Program(fn)


async def run_batch(
    prog: Program,
    ctx: Context | ContextPool,
    inputs: Sequence[Any],
    *,
    concurrency: int | None = None,
    params: SamplingParams | None = None,
    chat_template: str | None = None,
    progress: bool | TextIO | None = None,
) -> list[ProgramState]:
    """Run ``prog`` once per input, ``concurrency`` at a time, and return
    the states in input order. An input is a mapping (keyword arguments), a
    tuple (positional arguments) or one argument. The programs run as
    concurrent tasks, so their commits of a tick share one decode. If some
    raise, the others still finish (their KV freed), then the first error
    (in input order) is raised.

    ``concurrency`` defaults to the context's free KV leases (a program
    that forks needs one more lease per fork: lower it then). On a
    :class:`lloyal.cluster.ContextPool` each program runs on the worker
    with the most free leases when it starts; ``concurrency`` defaults to
    the pool's free leases.
    ``progress``: a stream to report on (``True``: stderr; default: stderr
    when it is a terminal).

    >>> import asyncio, lloyal
    >>> @lloyal.program
    ... async def next_number(s, n):
    ...     s += f"{n}, {n + 1}, {n + 2},"
    ...     await s.gen("next", max_tokens=4, stop=",")
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         states = await next_number.run_batch(ctx, [1, 5], params=lloyal.GREEDY)
    ...         return [s["next"] for s in states]
    >>> asyncio.run(main())
    [' 4', ' 8']
    """
    if not isinstance(prog, Program):
        raise TypeError(f"run_batch runs a Program (@lloyal.program), got {type(prog).__name__}")
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError("inputs must be a sequence")
    if concurrency is None:
        if _is_pool(ctx):
            free = await cast("ContextPool", ctx).available()
        else:
            free = BranchStore(cast("Context", ctx)).available
        concurrency = max(1, free)
    _check.integer(concurrency, "concurrency")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    out = _progress_stream(progress)
    results: list[ProgramState | None] = [None] * len(inputs)
    limit = anyio.Semaphore(concurrency)
    done = 0

    async def one(i: int, item: Any) -> None:
        nonlocal done
        args, kwargs = _arguments(item)
        async with limit:
            results[i] = await prog.run(
                ctx, *args, params=params, chat_template=chat_template, **kwargs
            )
        done += 1
        if out is not None:
            out.write(
                f"\r{prog.__name__ if hasattr(prog, '__name__') else 'program'}: "
                f"{done}/{len(inputs)}"
            )
            out.flush()

    outcomes = await gather(*(one(i, item) for i, item in enumerate(inputs)))
    if out is not None:
        out.write("\n")
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return [r for r in results if r is not None]


def _is_pool(source: object) -> bool:
    """A ContextPool (duck-typed: lloyal.cluster needs Ray, an extra)."""
    return callable(getattr(source, "run_program", None))


def _arguments(item: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(item, Mapping):
        return (), dict(item)
    if isinstance(item, tuple):
        return item, {}
    return (item,), {}


def _progress_stream(progress: bool | TextIO | None) -> TextIO | None:
    if progress is None:
        return sys.stderr if sys.stderr.isatty() else None
    if progress is True:
        return sys.stderr
    if progress is False:
        return None
    return progress
