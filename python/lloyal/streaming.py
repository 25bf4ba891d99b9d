"""Scoring text longer than the context: BlinkKV reseeding vs eviction.

:func:`stream_perplexity` feeds a document through sequence 0 of a context
one token at a time and measures the model's perplexity on it, making room
whenever the KV cache is full by one of three policies:

- ``"none"``: never make room (the context must hold the whole document;
  this is the baseline);
- ``"reseed"``: BlinkKV -- clear the sequence and re-decode the first
  ``sinks`` tokens plus the last ``keep`` tokens at contiguous positions
  (:meth:`Context.clear_and_reseed`);
- ``"evict"``: naive eviction -- drop the oldest cells and keep counting
  positions, so the model sees position gaps it was never trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from lloyal import _lloyal

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["Policy", "stream_perplexity"]

Policy = Literal["none", "reseed", "evict"]


async def stream_perplexity(
    ctx: Context,
    tokens: Sequence[int],
    *,
    policy: Policy = "reseed",
    sinks: int = 4,
    keep: int | None = None,
) -> float:
    """Perplexity of ``tokens[1:]`` given what precedes each, decoding into
    sequence 0 (cleared first) and making room with ``policy`` whenever the
    cache is full. ``keep`` (default ``n_ctx // 2``) is how many recent
    tokens survive a reseed or an eviction.

    >>> import asyncio, lloyal
    >>> from lloyal.streaming import stream_perplexity
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_ctx=256) as ctx:
    ...         tokens = await ctx.tokenize("The quick brown fox jumps over the lazy dog. " * 40)
    ...         return await stream_perplexity(ctx, tokens, policy="reseed") < 3
    >>> asyncio.run(main())
    True
    """
    if policy not in ("none", "reseed", "evict"):
        raise ValueError(f"policy must be 'none', 'reseed' or 'evict', got {policy!r}")
    n_ctx = ctx.n_ctx
    keep = n_ctx // 2 if keep is None else keep
    if not 0 < keep < n_ctx - sinks or sinks < 0:
        raise ValueError(f"need 0 <= sinks and 0 < keep < n_ctx - sinks; got {sinks}, {keep}")
    ids = list(tokens)
    if len(ids) < 2:
        raise ValueError("need at least two tokens to score")
    await ctx.kv_cache_remove(0, 0)
    await ctx.decode(ids[:1], 0)
    tracker = _lloyal.PerplexityTracker()
    pos, held = 1, 1  # next position; cells sequence 0 holds
    for i in range(1, len(ids)):
        tracker.add(ctx.model_surprisal(ids[i]))
        if held == n_ctx and policy == "reseed":
            await ctx.clear_and_reseed(ids[:sinks], ids[max(sinks, i - keep) : i])
            pos = held = sinks + min(keep, i - sinks)
        elif held == n_ctx and policy == "evict":
            oldest = pos - held
            await ctx.kv_cache_remove(0, oldest, oldest + held - keep)
            held = keep
        await ctx.decode(ids[i : i + 1], pos)
        pos += 1
        held += 1
    return float(tracker.perplexity)
