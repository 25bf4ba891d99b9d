"""The Ray actor side: one lloyal context and the branches clients hold on it.

Clients name branches by small integers; every call takes lists, so one
Ray call can commit and produce for many branches (one decode for all the
commits). Plain data crosses the wire: token ids, bytes, dicts.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context, create_context
from lloyal.errors import LloyalError
from lloyal.prefix_cache import PrefixCache
from lloyal.sampling import SamplingParams

__all__ = ["ContextWorker"]


def _info(b: Branch) -> dict[str, Any]:
    return {"position": b.position, "perplexity": b.perplexity}


class ContextWorker:
    """Owns one context (made as a Ray actor by :class:`ContextPool`)."""

    def __init__(self, model_path: str, options: dict[str, Any], cache_branches: int) -> None:
        self._model_path = model_path
        self._options = options
        self._cache_branches = cache_branches
        self._ctx: Context | None = None
        self._branches: dict[int, Branch] = {}
        self._ids = itertools.count(1)

    async def start(self) -> dict[str, Any]:
        self._ctx = await create_context(self._model_path, **self._options)
        self._store = BranchStore(self._ctx)
        self._cache = PrefixCache(self._ctx, max_branches=self._cache_branches)
        return {
            "pid": os.getpid(),
            "n_seq_max": self._ctx.n_seq_max,
            "vocab": self._ctx.vocab_size,
        }

    def _keep(self, b: Branch) -> int:
        bid = next(self._ids)
        self._branches[bid] = b
        return bid

    async def tokenize(self, text: str, add_special: bool | None = None) -> list[int]:
        assert self._ctx is not None
        return await self._ctx.tokenize(text, add_special)

    async def detokenize(self, tokens: list[int]) -> str:
        assert self._ctx is not None
        return await self._ctx.detokenize(tokens)

    def load(self) -> dict[str, int]:
        """What placement looks at: branches held and leases free."""
        return {"branches": len(self._branches), "free": self._store.available}

    def match(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` the prefix cache holds already."""
        return self._cache.match(tokens)

    async def create(
        self, tokens: list[int], params: SamplingParams | None, seed: int | None
    ) -> tuple[int, dict[str, Any], int]:
        """A branch holding ``tokens`` (through the prefix cache); its id,
        info and how many tokens it decoded."""
        assert self._ctx is not None
        before = self._ctx.stats.tokens_decoded
        await self._cache.make_room(2)
        b = await self._cache.branch(tokens, params=params)
        if seed is not None:
            b.reseed_sampler(seed)
        return self._keep(b), _info(b), self._ctx.stats.tokens_decoded - before

    async def fork(self, bid: int, seeds: list[int | None]) -> list[tuple[int, dict[str, Any]]]:
        parent = self._branches[bid]
        out = []
        for seed in seeds:
            await self._cache.make_room(1)
            child = await parent.fork(root=True)
            if seed is not None:
                child.reseed_sampler(seed)
            out.append((self._keep(child), _info(child)))
        return out

    async def step(
        self, commits: list[tuple[int, int]], produce: list[int]
    ) -> tuple[list[str | dict[str, Any]], list[tuple[int, str, bool, float, float] | str]]:
        """Commit ``commits`` in one decode, then produce for ``produce``.
        Per item: the branch's new info (or an error message); a produced
        token as (token, text, is_stop, surprisal, entropy) (or an error)."""
        done: list[str | dict[str, Any]] = []
        live = [(bid, t) for bid, t in commits if bid in self._branches]
        if live:
            try:
                await self._store.commit([(self._branches[b], t) for b, t in live])
            except LloyalError as e:
                return [f"{type(e).__name__}: {e}"] * len(commits), []
        for bid, _ in commits:
            b = self._branches.get(bid)
            done.append(_info(b) if b is not None else f"no branch {bid} here")
        made: list[tuple[int, str, bool, float, float] | str] = []
        for bid in produce:
            b = self._branches.get(bid)
            if b is None:
                made.append(f"no branch {bid} here")
                continue
            try:
                p = await b.produce()
                made.append(
                    (p.token, p.text, p.is_stop, b.model_surprisal(p.token), b.model_entropy())
                )
            except LloyalError as e:
                made.append(f"{type(e).__name__}: {e}")
        return done, made

    async def prune(self, bids: list[int]) -> None:
        for bid in bids:
            b = self._branches.pop(bid, None)
            if b is not None and not b.disposed:
                await b.prune()

    async def export(self, bid: int) -> tuple[bytes, bytes, SamplingParams]:
        """What moves a branch: its state, its sampler's state, its params."""
        b = self._branches[bid]
        return await b.save(), b.sampler_state(), b.sampler_params

    async def adopt(
        self, state: bytes, sampler: bytes, params: SamplingParams
    ) -> tuple[int, dict[str, Any]]:
        assert self._ctx is not None
        await self._cache.make_room(1)
        b = await Branch.restore(self._ctx, state, params=params)
        b.set_sampler_state(sampler)
        return self._keep(b), _info(b)

    def stats(self) -> dict[str, int]:
        assert self._ctx is not None
        s = self._ctx.stats
        return {"decode_calls": s.decode_calls, "tokens_decoded": s.tokens_decoded}

    async def close(self) -> None:
        await self.prune(list(self._branches))
        await self._cache.aclose()
        if self._ctx is not None:
            await self._ctx.aclose()
