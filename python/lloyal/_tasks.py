"""Task helpers the package's loops share (strategies, agents, programs,
the cluster): running awaitables side by side under asyncio or trio."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio

__all__ = ["gather"]


async def gather(*aws: Awaitable[Any]) -> list[Any]:
    """Run ``aws`` concurrently (under asyncio or trio); each one's result,
    or the ``Exception`` it raised (``asyncio.gather`` with
    ``return_exceptions=True``). A cancellation is not caught."""
    results: list[Any] = [None] * len(aws)

    async def one(i: int, aw: Awaitable[Any]) -> None:
        try:
            results[i] = await aw
        except Exception as e:
            results[i] = e

    async with anyio.create_task_group() as tg:
        for i, aw in enumerate(aws):
            tg.start_soon(one, i, aw)
    return results
