"""Awaiting native work from asyncio (and uvloop) or trio.

Every asynchronous native call takes a ``done(error, value)`` callable that
the worker thread calls exactly once. ``call_native`` turns that into an
awaitable for whichever event loop is running: an asyncio future completed
with ``call_soon_threadsafe``, or a trio task rescheduled through its
``TrioToken``. Cancelling the awaiting task abandons the wait; the native
operation still runs to completion on the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import sniffio

Done = Callable[[BaseException | None, Any], None]


def _settle(fut: asyncio.Future[Any], error: BaseException | None, value: Any) -> None:
    if fut.done():  # cancelled while the worker ran
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


async def call_native(start: Callable[[Done], object]) -> Any:
    """Run ``start(done)`` and wait until the worker calls ``done``."""
    if sniffio.current_async_library() == "trio":
        return await _call_native_trio(start)
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def done(error: BaseException | None, value: Any) -> None:
        # RuntimeError: the loop is closed, so nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle, fut, error, value)

    start(done)
    return await fut


async def _call_native_trio(start: Callable[[Done], object]) -> Any:
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
