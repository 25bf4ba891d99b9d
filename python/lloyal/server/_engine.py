"""What the server does with a request, on the public lloyal API only.

Every request gets its prompt from the prefix cache (a fork of the longest
cached prefix, with only the rest prefilled) and one branch per choice
(``n`` choices are forks of one prompt). Each choice runs as its own task
that produces and commits a token at a time; the commits of all tasks of
all requests land in shared decodes (implicit batching). Admission counts
KV leases: a request waits until its ``n`` leases fit, and is refused with
429 once ``max_queue`` requests wait.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from lloyal.branch import Branch
from lloyal.context import Context
from lloyal.errors import KVCacheFullError, NoLeaseError
from lloyal.grammar import Grammar
from lloyal.prefix_cache import PrefixCache
from lloyal.server._protocol import ApiError, Generation
from lloyal.text import TextStream

__all__ = ["Engine", "Event", "Metrics"]


@dataclass(frozen=True)
class Event:
    """A step of one choice: text to send (stop strings already cut), the
    token it came with and its log-probabilities, or the end."""

    index: int
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    finish: str | None = None


@dataclass
class Metrics:
    requests: int = 0
    rejected: int = 0
    active: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    disconnects: int = 0
    started: float = field(default_factory=time.time)


class Engine:
    """One context serving many requests (see the module docs)."""

    def __init__(
        self,
        ctx: Context,
        *,
        prefix_cache: bool = True,
        cache_branches: int | None = None,
        max_queue: int = 64,
    ) -> None:
        self.ctx = ctx
        self.capacity = ctx.n_seq_max
        entries = cache_branches if cache_branches is not None else max(1, self.capacity // 4)
        self.cache = PrefixCache(ctx, max_branches=entries) if prefix_cache else None
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._reserved = 0
        self._turn = asyncio.Condition()
        self._eog: list[int] | None = None

    def _end_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (found once)."""
        if self._eog is None:
            self._eog = [t for t in range(self.ctx.vocab_size) if self.ctx.is_stop_token(t)]
        return self._eog

    @asynccontextmanager
    async def admitted(self, n: int) -> AsyncIterator[None]:
        """Hold ``n`` leases' worth of capacity for a request."""
        if n > self.capacity:
            raise ApiError(
                f"n={n} needs more KV sequences than the server has ({self.capacity})", param="n"
            )
        self.metrics.requests += 1
        async with self._turn:
            if self._reserved + n > self.capacity:
                if self.metrics.waiting >= self.max_queue:
                    self.metrics.rejected += 1
                    raise ApiError(
                        "the server is at capacity; retry shortly",
                        status=429,
                        kind="rate_limit_exceeded",
                    )
                self.metrics.waiting += 1
                try:
                    await self._turn.wait_for(lambda: self._reserved + n <= self.capacity)
                finally:
                    self.metrics.waiting -= 1
            self._reserved += n
            self.metrics.active += 1
        try:
            yield
        finally:
            async with self._turn:
                self._reserved -= n
                self.metrics.active -= 1
                self._turn.notify_all()

    async def _branches(self, tokens: list[int], gen: Generation) -> list[Branch]:
        """The prompt decoded (through the prefix cache) and ``n`` branches on it."""
        params = gen.params
        if gen.ignore_eos:
            banned = [(t, -1e4) for t in self._end_tokens()]
            params = params.with_(logit_bias=[*params.logit_bias, *banned])
        try:
            if self.cache is not None:
                root = await self.cache.branch(tokens, params=params)
                await self.cache.make_room(gen.n - 1)
            else:
                root = Branch.create(self.ctx, params)
                await root.prefill(tokens)
            branches = [root]
            for _ in range(gen.n - 1):
                branches.append(await root.fork(root=True))
        except NoLeaseError:
            raise ApiError(
                "no KV sequence is free; retry shortly", status=503, kind="server_error"
            ) from None
        except KVCacheFullError:
            raise ApiError("the prompt does not fit the KV cache", param="messages") from None
        # Forks continue their parent's random stream: each choice gets its own.
        base = gen.seed if gen.seed is not None else random.getrandbits(32)
        for i, b in enumerate(branches):
            b.reseed_sampler((base + i) % 2**32)
        return branches

    async def generate(
        self,
        tokens: list[int],
        gen: Generation,
        *,
        grammar: Grammar | None = None,
        stop_tokens: Sequence[int] = (),
        preserved: Sequence[int] = (),
    ) -> AsyncIterator[Event]:
        """Events of all ``gen.n`` choices as they come. Leaving the loop
        early (a client gone) cancels the choices and frees their branches."""
        if not tokens:
            raise ApiError("the prompt is empty", param="prompt")
        room = self.ctx.n_ctx - len(tokens)
        if room < 1:
            raise ApiError(
                f"the prompt has {len(tokens)} tokens; the context holds {self.ctx.n_ctx}",
                param="messages",
            )
        limit = min(gen.max_tokens or room, room)
        self.metrics.prompt_tokens += len(tokens)
        branches = await self._branches(tokens, gen)
        events: asyncio.Queue[Event] = asyncio.Queue()
        tasks = []
        try:
            for i, b in enumerate(branches):
                if grammar is not None:
                    b.set_grammar(grammar)
                choice = _Choice(self, i, b, gen, limit, set(stop_tokens), set(preserved))
                tasks.append(asyncio.create_task(choice.run(events)))
            finished = 0
            while finished < len(tasks):
                event = await events.get()
                if event.finish is not None:
                    finished += 1
                yield event
            for t in tasks:
                t.result()  # a choice that failed raises here
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for b in branches:
                if not b.disposed:
                    await b.prune()


class _Choice:
    """One choice's decode loop."""

    def __init__(
        self,
        engine: Engine,
        index: int,
        branch: Branch,
        gen: Generation,
        limit: int,
        stop_tokens: set[int],
        preserved: set[int],
    ) -> None:
        self.engine = engine
        self.index = index
        self.branch = branch
        self.gen = gen
        self.limit = limit
        self.stop_tokens = stop_tokens
        self.preserved = preserved

    async def run(self, events: asyncio.Queue[Event]) -> None:
        finish = "length"
        try:
            finish = await self._loop(events)
        finally:
            events.put_nowait(Event(self.index, finish=finish))

    async def _loop(self, events: asyncio.Queue[Event]) -> str:
        ctx, branch, gen = self.engine.ctx, self.branch, self.gen
        stream = TextStream(ctx)
        held = ""  # text that may be the start of a stop string
        for _ in range(self.limit):
            p = await branch.produce()
            if (p.is_stop or p.token in self.stop_tokens) and not gen.ignore_eos:
                return self._flush(events, held + stream.flush())
            logprob: float | None = None
            top: tuple[tuple[int, float], ...] = ()
            if gen.logprobs is not None:
                logprob = float(branch.logprobs([p.token])[0])
                if gen.logprobs > 0:
                    ids, lps = branch.top_logprobs(gen.logprobs)
                    top = tuple(zip(ids.tolist(), lps.tolist(), strict=True))
            try:
                await branch.commit(p.token)
            except KVCacheFullError:
                return self._flush(events, held + stream.flush())
            self.engine.metrics.completion_tokens += 1
            if p.token in self.preserved:
                piece = stream.flush() + ctx.token_to_text(p.token, render_special=True)
            else:
                piece = stream.push(p.token)
            held += piece
            cut = _first_stop(held, gen.stop)
            if cut is not None:
                events.put_nowait(Event(self.index, held[:cut], p.token, logprob, top))
                return "stop"
            keep = _partial_stop(held, gen.stop)
            ready, held = held[: len(held) - keep], held[len(held) - keep :]
            events.put_nowait(Event(self.index, ready, p.token, logprob, top))
        self._flush(events, held + stream.flush())
        return "length"

    def _flush(self, events: asyncio.Queue[Event], text: str) -> str:
        cut = _first_stop(text, self.gen.stop)
        if text:
            events.put_nowait(Event(self.index, text if cut is None else text[:cut]))
        return "stop"


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
