"""Awaiting native work from asyncio (and uvloop) or trio.

Every asynchronous native call takes a ``done`` object that the worker
thread completes exactly once. ``call_native`` turns that into an awaitable
for whichever event loop is running:

* asyncio / uvloop: each loop gets a :class:`_LoopWaker` -- a pipe the loop
  watches with ``add_reader`` and a native queue of finished results. The
  worker appends a result to the queue under the GIL (running no Python
  code), releases the GIL, then writes one byte to the pipe; the loop wakes
  once, drains every result that arrived (one wake-up for a whole batch)
  and settles their futures.
* trio: the worker reschedules the waiting task through its ``TrioToken``.

Cancelling the awaiting task abandons the wait; the native operation still
runs to completion on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Any

import sniffio

from lloyal import _lloyal

Done = Callable[[BaseException | None, Any], None]
Start = Callable[[Any], object]


class _LoopWaker:
    """The pipe and result queue that complete futures on one asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._read_fd, self.wake_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self.wake_fd, False)
        self._queue = _lloyal.ResultQueue(self.wake_fd)
        self._loop = loop
        loop.add_reader(self._read_fd, self._drain)

    def completion(self, fut: asyncio.Future[Any]) -> _lloyal.Completion:
        return _lloyal.Completion(fut, self._queue, self)

    def _drain(self) -> None:
        # Read the pokes before taking the results: a result is queued before
        # its poke, so none is left behind. More than 4096 pokes leave the
        # pipe readable, and the loop calls us again.
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        for fut, error, value in self._queue.drain():
            if fut.done():  # cancelled while the worker ran
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

    def __del__(self) -> None:
        # Runs only once no Completion refers to us any more, so the worker
        # can no longer write to wake_fd.
        with contextlib.suppress(Exception):
            if not self._loop.is_closed():
                self._loop.remove_reader(self._read_fd)
        for fd in (self._read_fd, self.wake_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]
_wakers = weakref.WeakKeyDictionary()


def _waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    waker = _wakers.get(loop)
    if waker is None:
        waker = _wakers[loop] = _LoopWaker(loop)
    return waker


async def call_native(start: Start) -> Any:
    """Run ``start(done)`` and wait until the worker completes ``done``."""
    if sniffio.current_async_library() == "trio":
        return await _call_native_trio(start)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    start(_waker(loop).completion(fut))
    return await fut


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
        if sniffio.current_async_library() == "trio":
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
        for n, waiter in enumerate(waiters):
            waiter.complete(error if error is not None or results is None else results[n])

    if sniffio.current_async_library() == "trio":
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
