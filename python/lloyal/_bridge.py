"""Awaiting native work from asyncio (and uvloop) or trio.

Every asynchronous native call takes a ``done`` object that the worker
thread completes exactly once. ``call_native`` turns that into an awaitable
for whichever event loop is running:

* asyncio / uvloop: each loop gets a :class:`_LoopWaker` -- a socket pair
  the loop watches with ``add_reader`` and a native queue of finished
  results. The worker appends a result to the queue and writes one byte to
  the socket, without taking the GIL; the loop wakes once, and the queue's
  native ``settle`` (the reader callback) settles the future of every result
  that arrived meanwhile (one wake-up for a whole batch). A socket pair, not
  a pipe: Windows' selector loop can watch sockets only.
  A loop without ``add_reader`` (Windows' default Proactor loop) is handed
  the results of one engine job with one ``call_soon_threadsafe`` instead
  (see :func:`_deliver`): the worker takes the GIL for it.
* trio: the worker hands the results of one job to :func:`_deliver`, which
  reschedules every task waiting on them through one ``run_sync_soon`` of
  their run's ``TrioToken`` (one wake-up for the batch, and the tasks run
  in the same round).

A call the native side answers while it is being made (a validation
error, a greedy produce, a short job run on the caller's thread) is
settled before ``call_native`` returns: asyncio's future is already done
when awaited (the caller goes on without yielding), and trio's task finds
its result at its checkpoint; neither goes through the socket or a
wake-up.

Cancelling the awaiting task abandons the wait; the native operation still
runs to completion on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import weakref
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from sniffio import current_async_library_cvar
from sniffio import thread_local as _sniffio_thread

from lloyal import _lloyal

Done = Callable[[BaseException | None, Any], None]
Start = Callable[[Any], object]


def _in_trio() -> bool:
    """Whether the running task is trio's: sniffio's own answer without its
    asyncio probe, which costs more than the whole rest of a call here."""
    return (_sniffio_thread.name or current_async_library_cvar.get()) == "trio"


class _LoopWaker:
    """The socket pair and result queue that complete futures on one
    asyncio loop. It holds its loop weakly: once the loop is gone, so are
    the waker and its sockets (the queue owns and closes both ends).

    A loop that cannot watch a socket (``add_reader`` raises
    ``NotImplementedError``: Windows' default Proactor loop, some embedded
    loops) gets :class:`_LoopDone` callbacks instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        read, wake = socket.socketpair()
        for end in (read, wake):
            end.setblocking(False)
        if wake.family in (socket.AF_INET, socket.AF_INET6):  # Windows: a loopback TCP pair
            wake.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._queue: _lloyal.ResultQueue | None = _lloyal.ResultQueue(read.detach(), wake.detach())
        try:
            loop.add_reader(self._queue.read_fd, self._queue.settle)
        except NotImplementedError:
            self._queue = None  # closes both ends

    def settle_ready(self) -> None:
        """Settle what is queued now, on the loop's thread: the answer of a
        call made just now that the native side knew at once."""
        queue = self._queue
        if queue is not None and queue.pending:
            queue.settle()

    def completion(self, fut: asyncio.Future[Any]) -> _lloyal.Completion | Done:
        """The ``done`` object that settles ``fut`` from the worker."""
        if self._queue is not None:
            return _lloyal.Completion(fut, self._queue)
        return _LoopDone(fut)

    def __del__(self) -> None:
        loop = self._loop()
        with contextlib.suppress(Exception):
            if self._queue is not None and loop is not None and not loop.is_closed():
                loop.remove_reader(self._queue.read_fd)


class _LoopDone:
    """The ``done`` of a call awaited on a loop that cannot watch a socket:
    :func:`_deliver` settles the futures of one job on one loop with one
    ``call_soon_threadsafe``."""

    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future[Any]) -> None:
        self.fut = fut

    def __call__(self, error: BaseException | None, value: Any) -> None:
        _deliver([(self, error, value)])


def _settle(fut: asyncio.Future[Any], error: BaseException | None, value: Any) -> None:
    if fut.done():  # cancelled while the worker ran
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _settle_all(results: list[tuple[asyncio.Future[Any], BaseException | None, Any]]) -> None:
    for fut, error, value in results:
        _settle(fut, error, value)


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]
_wakers = weakref.WeakKeyDictionary()


def _waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    waker = _wakers.get(loop)
    if waker is None:
        waker = _wakers[loop] = _LoopWaker(loop)
    return waker


def call_native(start: Start) -> Awaitable[Any]:
    """Run ``start(done)`` and return what to await until the worker
    completes ``done``. Under asyncio that is the future itself: no
    coroutine frame between the caller and the loop (this sits on every
    decode step's path)."""
    if _in_trio():
        return _call_native_trio(start)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    waker = _waker(loop)
    start(waker.completion(fut))
    # Answered already (an error, a greedy produce, a job run inline)?
    # Then the future is done before it is awaited: no round trip through
    # the socket and the loop, and the caller goes on without yielding.
    waker.settle_ready()
    return fut


class _TrioDone:
    """The ``done`` of a native call awaited under trio: hands the result to
    the run through its token (see :func:`_deliver`)."""

    __slots__ = ("token", "wake")

    def __init__(self, token: Any, wake: Callable[[Any], None]) -> None:
        self.token = token
        self.wake = wake

    def __call__(self, error: BaseException | None, value: Any) -> None:
        _deliver([(self, error, value)])


def _outcome(error: BaseException | None, value: Any) -> Any:
    import outcome

    return outcome.Error(error) if error is not None else outcome.Value(value)


def _wake_all(wakes: list[tuple[Callable[[Any], None], Any]]) -> None:
    for wake, result in wakes:
        wake(result)


def _deliver(calls: list[tuple[Done, BaseException | None, Any]]) -> None:
    """Complete the callable ``done``s of one engine job (the engine calls
    this once per job, from its thread, with the GIL). Those of a trio run
    are woken by one callback per run, so every task waiting on the job is
    rescheduled in the same round; those of an asyncio loop by one callback
    per loop."""
    by_run: dict[Any, list[tuple[Callable[[Any], None], Any]]] = {}
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any, Any]]] = {}
    # Answers given on the thread that waits for them (a call answered
    # while it was made) are delivered here and now, without a wake-up.
    here_loop = asyncio._get_running_loop()
    here_run = _current_trio_token() if here_loop is None and _in_trio() else None
    for done, error, value in calls:
        if isinstance(done, _TrioDone):
            if done.token is here_run:
                done.wake(_outcome(error, value))
            else:
                by_run.setdefault(done.token, []).append((done.wake, _outcome(error, value)))
        elif isinstance(done, _LoopDone):
            loop = done.fut.get_loop()
            if loop is here_loop:
                _settle(done.fut, error, value)
            else:
                by_loop.setdefault(loop, []).append((done.fut, error, value))
        else:
            done(error, value)
    for loop, results in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(_settle_all, results)
    if not by_run:
        return
    import trio

    for token, wakes in by_run.items():
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(_wake_all, wakes)


def _current_trio_token() -> Any:
    import trio

    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:  # not in a trio run after all
        return None


def _call_native_trio(start: Start) -> Awaitable[Any]:
    """Start the native call now (as under asyncio: the caller may have
    work queued behind a hold before it awaits) and return what waits for
    its result."""
    import trio

    # The waiting task once it waits; the result if it came first. Both
    # are only touched on trio's thread (`wake` runs there).
    waiting: list[Any] = []
    arrived: list[Any] = []
    abandoned = False

    def wake(result: Any) -> None:
        if abandoned:
            return
        if waiting:
            trio.lowlevel.reschedule(waiting[0], result)
        else:
            arrived.append(result)

    start(_TrioDone(trio.lowlevel.current_trio_token(), wake))

    async def wait() -> Any:
        if arrived:
            await trio.lowlevel.checkpoint()
            return arrived[0].unwrap()
        waiting.append(trio.lowlevel.current_task())

        def abort(_: Any) -> trio.lowlevel.Abort:
            nonlocal abandoned
            abandoned = True
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    return _Lazy(wait)


class _Lazy:
    """Awaitable that makes its coroutine only when awaited: one that is
    never awaited (its task was cancelled first) warns of nothing."""

    __slots__ = ("_make",)

    def __init__(self, make: Callable[[], Awaitable[Any]]) -> None:
        self._make = make

    def __await__(self) -> Generator[Any, None, Any]:
        return self._make().__await__()
