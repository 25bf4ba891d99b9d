"""The calls a pool's :class:`PoolWorker` holds back for one round trip, and
their results turned back into what a local branch would have raised."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from lloyal import errors
from lloyal.errors import LloyalError

Item = tuple[tuple[Any, ...], int, "asyncio.Future[Any]"]
"""A queued call: its arguments, the worker generation it was made for,
and the future its result goes to."""


@dataclass
class Pending:
    prunes: list[Item] = field(default_factory=list)
    commits: list[Item] = field(default_factory=list)
    produces: list[Item] = field(default_factory=list)
    tops: list[Item] = field(default_factory=list)

    def queues(self) -> list[list[Item]]:
        return [self.prunes, self.commits, self.produces, self.tops]

    def futures(self) -> list[asyncio.Future[Any]]:
        return [f for queue in self.queues() for _, _, f in queue]

    def empty(self) -> bool:
        return not any(self.queues())

    def drop_stale(self, generation: int) -> list[asyncio.Future[Any]]:
        """Take out the calls made for an actor that has died since (the
        replacement does not know their branches); their futures."""
        stale = []
        for queue in self.queues():
            stale += [f for _, g, f in queue if g != generation]
            queue[:] = [item for item in queue if item[1] == generation]
        return stale


@dataclass(frozen=True)
class RemoteError:
    """An exception as it crosses from a worker to its clients: the name of
    its type and its message (plain data, so that any client can read it)."""

    kind: str
    message: str

    @classmethod
    def of(cls, e: BaseException) -> RemoteError:
        return cls(type(e).__name__, str(e))

    def exception(self) -> Exception:
        """The lloyal exception it names (or the builtin ``ValueError``,
        ``TypeError``, ``IndexError``); a bare ``LloyalError`` for any
        other kind."""
        kind = getattr(errors, self.kind, None)
        if isinstance(kind, type) and issubclass(kind, LloyalError):
            return kind(self.message)
        builtin = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError}
        if self.kind in builtin:
            return builtin[self.kind](self.message)
        return LloyalError(f"{self.kind}: {self.message}")


def settle(f: asyncio.Future[Any], result: Any) -> None:
    if f.done():
        return
    if isinstance(result, RemoteError):
        f.set_exception(result.exception())
    else:
        f.set_result(result)


def quiet(f: asyncio.Future[Any]) -> None:
    """Retrieve a future's outcome nobody waits for (no warning)."""
    if not f.cancelled():
        f.exception()
