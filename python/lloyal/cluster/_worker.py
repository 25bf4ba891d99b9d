"""The Ray actor side: one lloyal context and the branches clients hold on it.

Clients name branches by small integers; every call takes lists, so one
Ray call can commit and produce for many branches (one decode for all the
commits). Plain data crosses the wire: token ids, bytes, dicts.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from lloyal.branch import Branch, BranchStore
from lloyal.cluster._calls import RemoteError
from lloyal.context import Context, create_context
from lloyal.errors import KVCacheFullError, LloyalError, NoLeaseError
from lloyal.prefix_cache import PrefixCache
from lloyal.sampling import SamplingParams

__all__ = ["ContextWorker"]


def _info(b: Branch) -> dict[str, Any]:
    return {"position": b.position, "perplexity": b.perplexity}


def _gone(bid: int) -> RemoteError:
    return RemoteError("LloyalError", f"no branch {bid} here")


class ContextWorker:
    """Owns one context (made as a Ray actor by :class:`ContextPool`)."""

    def __init__(self, model_path: str, options: dict[str, Any], cache_branches: int) -> None:
        self._model_path = model_path
        self._options = options
        self._cache_branches = cache_branches
        self._ctx: Context | None = None
        self._branches: dict[int, Branch] = {}
        self._ids = itertools.count(1)
        self._made = 0  # branches made so far

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
        self._made = bid
        self._branches[bid] = b
        return bid

    async def tokenize(self, text: str, add_special: bool | None = None) -> list[int]:
        assert self._ctx is not None
        return await self._ctx.tokenize(text, add_special)

    async def detokenize(self, tokens: list[int]) -> str:
        assert self._ctx is not None
        return await self._ctx.detokenize(tokens)

    def load(self) -> dict[str, int]:
        """What placement looks at: branches held (and made so far), leases
        free (counting the prefix cache's entries, which give theirs back on
        demand) and KV cells no branch holds."""
        assert self._ctx is not None
        return {
            "branches": len(self._branches),
            "made": self._made,
            "free": self._store.available + len(self._cache),
            "cells_free": self._ctx.n_ctx - self._store.cells_held,
        }

    async def run_program(
        self,
        prog: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        params: SamplingParams | None,
        chat_template: str | None,
    ) -> dict[str, Any]:
        """Run a :class:`lloyal.Program` on this worker's context (its
        commits share decodes with whatever else runs here); the finished
        state as plain data."""
        assert self._ctx is not None
        await self._cache.make_room(1)
        state = await prog.run(
            self._ctx, *args, params=params, chat_template=chat_template, **kwargs
        )
        return dict(state.snapshot())

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

    async def fork(
        self, bid: int, seeds: list[int | None]
    ) -> list[tuple[int, dict[str, Any]] | None]:
        """Children of ``bid``, each reseeded if given a seed; ``None`` for
        each one no lease was left for (the client makes those elsewhere)."""
        parent = self._branches[bid]
        out: list[tuple[int, dict[str, Any]] | None] = []
        try:
            for seed in seeds:
                try:
                    # (make_room can say yes and a concurrent call take the
                    # lease before the fork: the fork's refusal is the answer.)
                    await self._cache.make_room(1)
                    child = await parent.fork(root=True)
                except NoLeaseError:
                    out.append(None)
                    continue
                made = self._keep(child)
                out.append((made, _info(child)))
                if seed is not None:
                    child.reseed_sampler(seed)
        except BaseException:
            await self.prune([m[0] for m in out if m is not None])  # all or none
            raise
        return out

    async def step(
        self,
        prunes: list[int],
        commits: list[tuple[int, int]],
        produces: list[int],
        tops: list[tuple[int, int]],
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """Prune ``prunes``; commit ``commits`` in one decode; produce for
        ``produces``; the top-k of ``tops``. Per commit: the branch's new
        info; per produce: (token, text, is_stop, surprisal, entropy); per
        top: (tokens, logprobs, entropy, stops). An error is a message in
        its place; a branch whose commit failed is not sampled after it."""
        await self.prune(prunes)
        failed = await self._commit(commits)
        done = [failed.get(bid) or _info(self._branches[bid]) for bid, _ in commits]
        made: list[Any] = [
            failed.get(bid, _gone(bid)) if bid in failed or bid not in self._branches else None
            for bid in produces
        ]
        # Every live branch's token in one native call (slow samplers in
        # parallel); a branch that fails is its own answer, the step goes on.
        live = [i for i, m in enumerate(made) if m is None]
        chosen = await self._store.produce(
            [self._branches[produces[i]] for i in live], return_exceptions=True
        )
        for i, p in zip(live, chosen, strict=True):
            b = self._branches[produces[i]]
            if isinstance(p, BaseException):
                made[i] = RemoteError.of(p)
                continue
            try:
                made[i] = (
                    p.token,
                    p.text,
                    p.is_stop,
                    b.model_surprisal(p.token),
                    b.model_entropy(),
                )
            except Exception as e:
                made[i] = RemoteError.of(e)
        top: list[Any] = []
        for bid, k in tops:
            held = self._branches.get(bid)
            if held is None or bid in failed:
                top.append(failed.get(bid, _gone(bid)))
                continue
            try:
                tokens, logprobs = held.top_logprobs(k)
                ids = tokens.tolist()
                assert self._ctx is not None
                stops = [self._ctx.is_stop_token(t) for t in ids]
                top.append((ids, logprobs.tolist(), held.model_entropy(), stops))
            except Exception as e:
                top.append(RemoteError.of(e))
        return done, made, top

    async def _commit(self, commits: list[tuple[int, int]]) -> dict[int, RemoteError]:
        """Commit in one decode; the error message of each that failed.
        When the KV cache cannot take them all (the batch is all or
        nothing), the prefix cache is dropped and the commits are sent again
        as separate groups of one step: the ones that fit land, the rest
        fail with KVCacheFullError (see docs/batching.md)."""
        failed = {bid: _gone(bid) for bid, _ in commits}
        live = [(bid, t) for bid, t in commits if bid in self._branches]
        for bid, _ in live:
            del failed[bid]
        if not live:
            return failed
        try:
            errors = await self._store.commit(
                [(self._branches[b], t) for b, t in live], return_exceptions=True
            )
        except KVCacheFullError:
            await self._cache.clear()
        except LloyalError as e:  # the whole call: none was committed
            return failed | {bid: RemoteError.of(e) for bid, _ in live}
        else:
            for (bid, _), error in zip(live, errors, strict=True):
                if error is not None:  # this one alone: the others are in
                    failed[bid] = RemoteError.of(error)
            return failed
        # Separate groups in one step: the engine lands the ones that fit.
        outcomes = await asyncio.gather(
            *(self._branches[b].commit(t) for b, t in live), return_exceptions=True
        )
        for (bid, _), outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, LloyalError):
                failed[bid] = RemoteError.of(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
        return failed

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
        self, state: bytes, sampler: bytes, params: SamplingParams, seed: int | None = None
    ) -> tuple[int, dict[str, Any]]:
        """A branch from :meth:`export`'s bytes (reseeded if given a seed)."""
        assert self._ctx is not None
        await self._cache.make_room(1)
        b = await Branch.restore(self._ctx, state, params=params)
        try:
            b.set_sampler_state(sampler)
            if seed is not None:
                b.reseed_sampler(seed)
        except BaseException:
            await b.prune()
            raise
        return self._keep(b), _info(b)

    def token_texts(self, tokens: list[int]) -> list[str]:
        """Each token's text (for trees of tokens)."""
        assert self._ctx is not None
        return [self._ctx.token_to_text(t) for t in tokens]

    def stats(self) -> dict[str, int]:
        assert self._ctx is not None
        s = self._ctx.stats
        return {"decode_calls": s.decode_calls, "tokens_decoded": s.tokens_decoded}

    async def close(self) -> None:
        await self.prune(list(self._branches))
        await self._cache.aclose()
        if self._ctx is not None:
            await self._ctx.aclose()
