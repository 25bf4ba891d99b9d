"""The one coalescer: what the tasks of one event-loop tick decode goes to
the worker as one step.

Every decode of branch tokens -- ``Branch.commit``, ``Branch.prefill``,
``BranchStore.commit``, ``BranchStore.prefill`` -- is a *group*: one
caller's batch, all or nothing. The first group of a tick (per thread, so
per event loop) waits one scheduler checkpoint, so that every task that is
runnable in this tick adds its own group, then sends them all in one native
call. The worker runs that step together with any other steps queued next
to it (other threads, other loops, the Rust API): one ``llama_decode`` per
round, every commit plus prompt tokens up to ``n_batch``, a long prompt
spread over several rounds. Each group is answered on its own, and groups
never fail each other (see ``docs/batching.md``).

A group whose caller is cancelled carries a set :class:`CancelFlag`: the
worker stops it at its next round and undoes what it decoded, so a prompt
nobody waits for any more does not keep the worker busy (a client that
left the server). One that has finished by then stands.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lloyal._bridge import _in_trio, call_native
from lloyal._lloyal import CancelFlag

if TYPE_CHECKING:
    from lloyal._lloyal import NativeBranch
    from lloyal.context import Context

__all__ = ["sent", "submit"]

# An item: (branch, token) to commit or (branch, [tokens]) to prefill. A
# group: (items, all_rows, done, cancel).
Item = tuple["NativeBranch", int | list[int]]
Group = tuple[Sequence[Item], bool, Any, CancelFlag]


def _local(ctx: Context) -> threading.local:
    local: threading.local | None = ctx.__dict__.get("_step_tick")
    if local is None:
        local = ctx.__dict__.setdefault("_step_tick", threading.local())
    return local


async def _checkpoint() -> None:
    if _in_trio():
        import trio

        await trio.lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)


async def submit(
    ctx: Context, items: Sequence[Item], all_rows: bool = False
) -> list[BaseException | None] | None:
    """Decode ``items`` as one group of this tick's step; the per-item
    errors (``None`` where an item succeeded; ``None`` for the list when
    none failed). Raises the group's error
    (``KVCacheFullError``: nothing in the group happened). Cancelling the
    awaiting task gives the group up: the worker stops it at its next
    round and puts its branches back as they were, unless it has finished
    by then; either way each branch is wholly before or wholly after it."""
    local = _local(ctx)
    cancel = CancelFlag()
    joined: list[Group] | None = getattr(local, "tick", None)
    try:
        if joined is not None:
            tick = joined
            errors: list[BaseException | None] | None = await call_native(
                lambda done: tick.append((items, all_rows, done, cancel))
            )
            return errors
        tick = local.tick = []
        result = call_native(lambda done: tick.append((items, all_rows, done, cancel)))
        try:
            await _checkpoint()
        except BaseException:
            cancel.set()  # before the tick goes: the worker never decodes it
            raise
        finally:
            # Sent even when this task is cancelled: the other tasks' groups
            # are in it.
            local.tick = None
            ctx._native.branch_step(tick)
        errors = await result
        return errors
    except BaseException:
        cancel.set()
        raise


async def sent(ctx: Context) -> None:
    """Return once this thread's pending tick (groups issued but not yet
    handed to the worker) has been sent, so that what the caller queues
    next runs after them: a prune issued right after a prefill waits for
    it instead of disposing of the branch under it."""
    local = _local(ctx)
    while getattr(local, "tick", None) is not None:
        await _checkpoint()
