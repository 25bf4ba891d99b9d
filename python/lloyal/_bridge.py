"""Awaiting native work from asyncio (and uvloop) or trio.

Every asynchronous native call takes a ``done`` object that the worker
thread completes exactly once. ``call_native`` turns that into an awaitable
for whichever event loop is running:

* asyncio / uvloop: each loop gets a :class:`_LoopWaker` -- a pipe the loop
  watches with ``add_reader`` and a native queue of finished results. The
  worker appends a result to the queue and writes one byte to the pipe,
  without taking the GIL; the loop wakes once, and the queue's native
  ``settle`` (the reader callback) settles the future of every result that
  arrived meanwhile (one wake-up for a whole batch).
  A loop without ``add_reader`` (Windows' Proactor loop) is handed each
  result with ``call_soon_threadsafe`` instead.
* trio: the worker reschedules the waiting task through its ``TrioToken``.

Cancelling the awaiting task abandons the wait; the native operation still
runs to completion on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import Awaitable, Callable
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
    """The pipe and result queue that complete futures on one asyncio loop.
    It holds its loop weakly: once the loop is gone, so are the waker and
    its pipe (the queue owns and closes both ends).

    A loop that cannot watch a file descriptor (``add_reader`` raises
    ``NotImplementedError``: Windows' default Proactor loop, some embedded
    loops) gets plain callbacks instead: the worker takes the GIL to hand
    each result to the loop with ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        read_fd, wake_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(wake_fd, False)
        self._queue: _lloyal.ResultQueue | None = _lloyal.ResultQueue(read_fd, wake_fd)
        try:
            loop.add_reader(read_fd, self._queue.settle)
        except NotImplementedError:
            self._queue = None  # closes both ends

    def completion(self, fut: asyncio.Future[Any]) -> _lloyal.Completion | Done:
        """The ``done`` object that settles ``fut`` from the worker."""
        if self._queue is not None:
            return _lloyal.Completion(fut, self._queue)
        loop = fut.get_loop()

        def done(error: BaseException | None, value: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_settle, fut, error, value)

        return done

    def __del__(self) -> None:
        loop = self._loop()
        with contextlib.suppress(Exception):
            if self._queue is not None and loop is not None and not loop.is_closed():
                loop.remove_reader(self._queue.read_fd)


def _settle(fut: asyncio.Future[Any], error: BaseException | None, value: Any) -> None:
    if fut.done():  # cancelled while the worker ran
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


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
    start(_waker(loop).completion(fut))
    return fut


async def _call_native_trio(start: Start) -> Any:
    import outcome
    import trio

    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    abandoned = False

    def done(error: BaseException | None, value: Any) -> None:
        result = outcome.Error(error) if error is not None else outcome.Value(value)

        def wake() -> None:
            if not abandoned:
                trio.lowlevel.reschedule(task, result)

        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(wake)

    start(done)

    def abort(_: Any) -> trio.lowlevel.Abort:
        nonlocal abandoned
        abandoned = True
        return trio.lowlevel.Abort.SUCCEEDED

    return await trio.lowlevel.wait_task_rescheduled(abort)


class Waiter:
    """One result that a batched native call completes, awaitable from the
    task that created it (asyncio or trio)."""

    def __init__(self) -> None:
        self._error: BaseException | None = None
        self.abandoned = False
        if _in_trio():
            import trio

            self._event: Any = trio.Event()
            self._fut: asyncio.Future[None] | None = None
        else:
            self._fut = asyncio.get_running_loop().create_future()

    def complete(self, error: BaseException | None) -> None:
        """Settle with ``error`` (or success); on the event loop's thread."""
        if self._fut is not None:
            if not self._fut.done():
                if error is not None:
                    self._fut.set_exception(error)
                else:
                    self._fut.set_result(None)
        elif not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> None:
        try:
            if self._fut is not None:
                await self._fut
                return
            await self._event.wait()
        except BaseException:
            self.abandoned = True
            raise
        if self._error is not None:
            raise self._error


def start_batch(start: Start, waiters: list[Waiter]) -> None:
    """Run ``start(done)`` for a batched native call whose value is one
    ``None``-or-exception per waiter; settle the waiters when it finishes
    (one event-loop wake-up for the whole batch). Call on the loop thread."""

    def distribute(error: BaseException | None, results: list[BaseException | None] | None) -> None:
        # `results` is None when every item succeeded (or `error` is set).
        for n, waiter in enumerate(waiters):
            waiter.complete(error if error is not None or results is None else results[n])

    if _in_trio():
        import trio

        token = trio.lowlevel.current_trio_token()

        def done(error: BaseException | None, value: Any) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(distribute, error, value)

        try:
            start(done)
        except BaseException as e:
            distribute(e, None)
        return
    loop = asyncio.get_running_loop()
    batch: asyncio.Future[Any] = loop.create_future()

    def finish(f: asyncio.Future[Any]) -> None:
        if not f.cancelled():
            error = f.exception()
            distribute(error, None if error is not None else f.result())

    batch.add_done_callback(finish)
    try:
        start(_waker(loop).completion(batch))
    except BaseException as e:
        batch.set_exception(e)
