"""What the server does with a request, on the public lloyal API only.

Every request gets its prompt from the prefix cache (a fork of the longest
cached prefix, with only the rest prefilled) and one branch per choice
(``n`` choices are forks of one prompt); when the request ends, its first
choice's branch becomes the cache's entry for the prompt and the reply
(:meth:`PrefixCache.keep`), so the next turn of a conversation decodes
only what is new. One step loop drives every choice of every request:
each produces a token, which is streamed at once, then all are committed
in one ``BranchStore.commit``, so a step costs one decode however many
requests are running; a choice's last token is not decoded. A request's
choices join at the next step. What one choice raises while its token is
chosen, read or committed ends that choice's request with an error and
touches no other. A new request's prompt is prefilled from its own task:
the engine's step scheduler decodes it in chunks that share decodes with
the running commits, at most ``step_tokens`` a step while choices stream
(``Context.step_tokens``). A request whose prompt is in waits for the
prompts in flight at that moment before its first token: a burst starts
streaming together, not its first streams behind the rest of its prompts.

Admission counts KV leases and KV cells: a request waits until its ``n``
leases and its cells -- the prompt plus ``max_tokens`` per choice
(``DEFAULT_RESERVE`` without ``max_tokens``) -- fit beside what the
admitted requests reserved, and is refused with 429 (``Retry-After``) once
``max_queue`` requests wait. Cached prefixes use the cells nobody
reserved: they are evicted, least recently used first, whenever a prompt or
a step needs their cells, so pressure never turns into an error for a
request that fits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from lloyal.adapters import Lora
from lloyal.branch import Branch, BranchStore, Produced
from lloyal.context import Context
from lloyal.errors import KVCacheFullError, LloyalError, NoLeaseError
from lloyal.grammar import Grammar
from lloyal.media import has_media
from lloyal.prefix_cache import PrefixCache
from lloyal.server._adapters import request_set
from lloyal.server._choice import Choice, ChoiceEvent, Ending, Metrics
from lloyal.server._protocol import ApiError, RequestOptions
from lloyal.server._speculation import drafting

__all__ = ["DEFAULT_RESERVE", "ChoiceEvent", "Metrics", "Scheduler"]

_Logprobs = tuple[float, list[int], list[float]]
log = logging.getLogger("lloyal.server")

DEFAULT_RESERVE = 512
"""Cells reserved per choice for a request without ``max_tokens``. Such a
request may generate past it while cells are free; under pressure it ends
with ``finish_reason: "length"`` once it has."""


class Scheduler:
    """One context serving many requests (see the module docs)."""

    def __init__(
        self,
        ctx: Context,
        *,
        prefix_cache: bool = True,
        cache_branches: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_queue: int = 64,
        spec_k: int = 0,
        draft: Context | None = None,
        ctx_shift: bool = False,
        n_keep: int = 4,
        step_tokens: int | None = None,
    ) -> None:
        self.ctx = ctx
        # The context's step budget while choices stream (None: n_batch);
        # with none streaming, prompts are decoded n_batch at a time.
        self.step_tokens = step_tokens
        # Context shift (llama-server's --context-shift, by BlinkKV): a
        # prompt over the context keeps its first n_keep tokens and its
        # end; a reply that reaches the context's end is reseeded with the
        # first n_keep tokens and the latest half context (``_shift``).
        self.ctx_shift = ctx_shift
        self.n_keep = n_keep
        # Prompt lookup drafts per round (0: no speculation; _speculation).
        self.spec_k = spec_k
        # A draft model's context (``--model-draft``); None: prompt lookup.
        self.draft = draft
        # With the prefix cache, one sequence stays for the entry a request
        # forks from (the cache gives the others back when leases run short).
        self.capacity = max(1, ctx.n_seq_max - 1) if prefix_cache else ctx.n_seq_max
        entries = cache_branches if cache_branches is not None else max(1, ctx.n_seq_max // 4)
        self.cache = (
            PrefixCache(ctx, max_branches=entries, disk_dir=cache_dir) if prefix_cache else None
        )
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._reserved = 0
        self._reserved_cells = 0
        self._turn = asyncio.Condition()
        self._store = BranchStore(ctx)
        self._active: list[Choice] = []
        self._wake = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None
        # The requests whose prompts are being prefilled, each with the
        # event set when its prompt is in (see ``_start_together``).
        self._prefilling: set[asyncio.Event] = set()
        self._eog: list[int] | None = None
        # The adapters ``--lora`` loaded, by id (see ``_adapters``).
        self.loras: list[Lora] = []

    def _end_tokens(self) -> list[int]:
        """Every end-of-generation token of the vocabulary (found once)."""
        if self._eog is None:
            self._eog = [t for t in range(self.ctx.vocab_size) if self.ctx.is_stop_token(t)]
        return self._eog

    def fit(self, tokens: list[int]) -> list[int]:
        """The prompt as the engine decodes it: with context shift, one
        over the context keeps its first ``n_keep`` tokens and its last
        half context less those (a prompt with media is never cut)."""
        n_ctx = self.ctx.n_ctx
        if not self.ctx_shift or len(tokens) < n_ctx or has_media(tokens):
            return tokens
        keep = min(self.n_keep, n_ctx // 4)
        return tokens[:keep] + tokens[len(tokens) - (n_ctx // 2 - keep) :]

    def cells_needed(self, tokens: Sequence[int], gen: RequestOptions) -> int:
        """The KV cells a request reserves: its prompt, and ``max_tokens``
        (``DEFAULT_RESERVE`` without it) for each choice, at most the whole
        cache."""
        room = self.ctx.n_ctx - len(tokens)
        per_choice = min(gen.max_tokens or DEFAULT_RESERVE, max(room, 0))
        return min(len(tokens) + gen.n * per_choice, self.ctx.n_ctx)

    @asynccontextmanager
    async def admitted(self, tokens: Sequence[int], gen: RequestOptions) -> AsyncIterator[None]:
        """Hold ``gen.n`` leases and the request's cells (see
        :meth:`cells_needed`) for a request: wait while they do not fit
        beside the admitted requests', 429 past ``max_queue`` waiting."""
        n = gen.n
        if n > self.capacity:
            raise ApiError(
                f"n={n} needs more KV sequences than the server has ({self.capacity})", param="n"
            )
        tokens = self.fit(list(tokens))
        if len(tokens) >= self.ctx.n_ctx:
            raise _too_long(len(tokens), self.ctx.n_ctx)
        cells = self.cells_needed(tokens, gen)
        self.metrics.requests += 1

        def fits() -> bool:
            return (
                self._reserved + n <= self.capacity
                and self._reserved_cells + cells <= self.ctx.n_ctx
            )

        async with self._turn:
            if not fits():
                if self.metrics.waiting >= self.max_queue:
                    self.metrics.rejected += 1
                    raise ApiError(
                        "the server is at capacity; retry shortly",
                        status=429,
                        kind="rate_limit_exceeded",
                    )
                self.metrics.waiting += 1
                try:
                    await self._turn.wait_for(fits)
                finally:
                    self.metrics.waiting -= 1
            self._reserved += n
            self._reserved_cells += cells
            self.metrics.active += 1
        try:
            yield
        finally:
            async with self._turn:
                self._reserved -= n
                self._reserved_cells -= cells
                self.metrics.active -= 1
                self._turn.notify_all()

    async def _branches(self, tokens: list[int], gen: RequestOptions) -> tuple[list[Branch], int]:
        """The prompt decoded (through the prefix cache) and ``n`` branches
        on it; how many prompt tokens the cache gave."""
        params = gen.params
        if gen.ignore_eos:
            banned = [(t, -1e4) for t in self._end_tokens()]
            params = params.with_(logit_bias=[*params.logit_bias, *banned])
        adapters = request_set(self.ctx, self.loras, gen.lora)
        cached = 0
        try:
            if self.cache is not None:
                # No entry is forked now: the branch itself becomes one
                # when the request ends (``generate``), holding the reply too.
                root, cached = await self.cache.branch_reusing(
                    tokens, params=params, remember=False, adapters=adapters
                )
                if gen.n > 1:
                    await self.cache.make_room(gen.n - 1)
            else:
                root = Branch.create(self.ctx, params)
                root.set_adapters(list(adapters.loras), control_vector=adapters.control_vector)
                await root.prefill(tokens)
            branches = [root]
            for _ in range(gen.n - 1):
                branches.append(await root.fork(root=True))
        except NoLeaseError:
            raise ApiError(
                "no KV sequence is free; retry shortly", status=503, kind="server_error"
            ) from None
        except KVCacheFullError:
            # Admitted with its cells reserved, so only cells held by
            # branches being pruned right now are in the way: retryable.
            raise ApiError(
                "the KV cache is full for now; retry shortly", status=503, kind="server_error"
            ) from None
        # Forks continue their parent's random stream: each choice gets its own.
        base = gen.seed if gen.seed is not None else random.getrandbits(32)
        for i, b in enumerate(branches):
            b.reseed_sampler((base + i) % 2**32)
        return branches, cached

    async def _start(self, choices: list[Choice]) -> None:
        """Choose and send new choices' first tokens now, from the request's
        own task (their logits are ready once the prompt is in), then let
        them join the step loop, whose next commit decodes those tokens: a
        request does not wait for the step in progress to send its first
        token."""
        produced = await self._produce(choices)
        joining = []
        for c, token in zip(choices, self._decide(choices, produced), strict=True):
            c.next = token
            if token is not None:
                joining.append(c)
        self._join(joining)

    async def _produce(self, choices: list[Choice]) -> list[Produced | Exception]:
        """Each choice's next token, or what its branch raised instead."""
        branches = [c.branch for c in choices]
        try:
            return list(await self._store.produce(branches, return_exceptions=True))
        except Exception:
            # An error other than a LloyalError (a ValueError from a
            # sampler) is raised for the whole call, after the other
            # branches chose: choose again one branch at a time, so that
            # the one that fails fails alone.
            out: list[Produced | Exception] = []
            for b in branches:
                try:
                    out.append(await b.produce())
                except Exception as e:
                    out.append(e)
            return out

    def _logprobs(self, asking: list[tuple[Choice, Produced]]) -> list[_Logprobs | Exception]:
        """The logprob entries of the choices that asked for them, read in
        one native call (one call per choice if that one fails)."""
        if not asking:
            return []
        try:
            top = max(c.gen.logprobs or 0 for c, _ in asking)
            read = self._store.logprobs([(c.branch, p.token) for c, p in asking], top=top)
        except Exception as e:
            if len(asking) == 1:
                return [e]
            return [r for one in asking for r in self._logprobs([one])]
        out: list[_Logprobs | Exception] = []
        for (c, _), (lp, ids, lps) in zip(asking, read, strict=True):
            k = c.gen.logprobs or 0
            out.append((lp, ids[:k], lps[:k]))
        return out

    def _decide(
        self, choices: list[Choice], produced: Sequence[Produced | Exception]
    ) -> list[int | None]:
        """Each choice's token to commit (None: it ended). A choice whose
        branch failed, or that fails to take its token, ends alone with
        an error."""
        asking = [
            (c, p)
            for c, p in zip(choices, produced, strict=True)
            if c.gen.logprobs is not None and isinstance(p, Produced)
        ]
        entries = {id(c): e for (c, _), e in zip(asking, self._logprobs(asking), strict=True)}
        tokens: list[int | None] = []
        for c, p in zip(choices, produced, strict=True):
            entry = entries.get(id(c))
            token = None
            if isinstance(p, Exception):  # a grammar that cannot continue, say
                c.fail(p)
            elif isinstance(entry, Exception):
                c.fail(entry)
            else:
                try:
                    token = c.decide(p, entry)
                except Exception as e:
                    c.fail(e)
            tokens.append(token)
        return tokens

    def _join(self, choices: list[Choice]) -> None:
        for c in choices:
            c.joined = True
        self._active.extend(choices)
        self._wake.set()
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._steps())

    async def _steps(self) -> None:
        """The step loop: every active choice produces a token, then all of
        them are committed in one ``BranchStore.commit`` (one decode), as
        llama-server steps its slots. Choices join between steps."""
        while True:
            self._active = [c for c in self._active if not c.released_if_cancelled()]
            if not self._active:
                # Nothing streams: prompts go n_batch at a time.
                self.ctx.step_tokens = None
                self._wake.clear()
                await self._wake.wait()
                continue
            self.ctx.step_tokens = self.step_tokens
            try:
                await self._step()
            except Exception as e:  # never leave requests waiting on a dead loop
                for c in self._active:
                    c.fail(e, "generation failed")
                self._active = []

    async def _step(self) -> None:
        batch: list[tuple[Choice, int]] = []
        active: list[Choice] = []
        for c in self._active:
            if c.next is not None:  # chosen when it joined
                batch.append((c, c.next))
                c.next = None
            else:
                active.append(c)
        # Every choice's token in one native call (grammar masks in parallel).
        produced = await self._produce(active)
        for c, token in zip(active, self._decide(active, produced), strict=True):
            if token is None:
                self._active.remove(c)
            else:
                batch.append((c, token))
        if self.ctx_shift:
            batch = [(c, t) for c, t in batch if await self._shift(c)]
        if not batch:
            return
        if all(c.drafts is None for c, _ in batch):  # the usual step: no speculation
            await self._commit(batch)
            return
        n_ctx = self.ctx.n_ctx
        plain: list[tuple[Choice, int]] = []
        drafted: list[tuple[Choice, int, list[int]]] = []
        # Each drafting choice's proposal (a draft model's decodes together).
        proposals = await asyncio.gather(
            *(self._propose(c, t, n_ctx) for c, t in batch), return_exceptions=True
        )
        for (c, t), guesses in zip(batch, proposals, strict=True):
            if isinstance(guesses, BaseException):
                # Drafting failed (the draft context, say): no drafts.
                log.warning("drafting failed for a choice", exc_info=guesses)
                guesses = []
            if guesses:
                drafted.append((c, t, guesses))
            else:
                plain.append((c, t))
        if not drafted:
            await self._commit(plain)
            return
        # The verifying prefills and the plain commits are decoded together
        # (the step scheduler coalesces what one tick submits).
        outs = await asyncio.gather(
            self._commit(plain), *(_verify(c, t, g) for c, t, g in drafted), return_exceptions=True
        )
        fallback: list[tuple[Choice, int]] = []
        for (c, t, _), out in zip(drafted, outs[1:], strict=True):
            if isinstance(out, BaseException):  # nothing decoded: commit the token alone
                fallback.append((c, t))
            elif out:
                self._active.remove(c)
        if isinstance(outs[0], BaseException):
            raise outs[0]
        await self._commit(fallback)

    @staticmethod
    async def _propose(c: Choice, token: int, n_ctx: int) -> list[int]:
        if c.drafts is None:
            return []
        room = min(c.limit - c.made, n_ctx - c.expected_position() - 1)
        return await c.drafts.propose(c.committed, token, room)

    async def _shift(self, c: Choice) -> bool:
        """Make room for the choice's next token if its branch is at the
        context's end: reseed it with the prompt's first ``n_keep`` tokens
        and the latest half context (BlinkKV: the sampler, grammar and
        reply so far are kept). False when the choice ended instead (its
        prompt holds media, or the reseed failed)."""
        n_ctx = self.ctx.n_ctx
        if c.expected_position() < n_ctx:
            return True
        history = [*c.prompt, *c.committed]
        keep = min(self.n_keep, n_ctx // 4)
        tail = n_ctx // 2 - keep
        if has_media(c.prompt):
            c.end("length")
        else:
            try:
                await c.branch.clear_and_reseed(history[:keep], history[-tail:])
                c.dropped = len(history) - keep - tail
                self.metrics.context_shifts += 1
                return True
            except Exception as e:
                c.fail(e)
        self._active.remove(c)
        return False

    async def _commit(self, batch: list[tuple[Choice, int]]) -> None:
        """Commit each choice's token in one ``BranchStore.commit``; a
        choice that cannot ends (``length`` when the cache is full even
        with no cached prefix, an error alone otherwise)."""
        if not batch:
            return
        items = [(c.branch, t) for c, t in batch]
        while True:
            try:
                outcomes = await self._store.commit(items, return_exceptions=True)
                break
            except KVCacheFullError:
                # Cached prefixes hold the cells nobody reserved: give them
                # back before ending anything.
                if self.cache is not None and await self.cache.evict_one():
                    continue
                for c, _ in batch:
                    c.end("length")
                    self._active.remove(c)
                return
            except Exception as e:  # the whole call: nothing was committed
                for c, _ in batch:
                    c.fail(e)
                    self._active.remove(c)
                return
        for (c, t), error in zip(batch, outcomes, strict=True):
            if error is None:
                c.committed.append(t)
            else:  # this branch alone is as it was
                c.fail(error)
                self._active.remove(c)

    async def aclose(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)
        if self.cache is not None:
            await self.cache.aclose()

    async def generate(
        self,
        tokens: list[int],
        gen: RequestOptions,
        *,
        grammar: Grammar | None = None,
        ending: Ending = Ending(),  # noqa: B008 (frozen)
    ) -> AsyncIterator[ChoiceEvent]:
        """Events of all ``gen.n`` choices as they come. Leaving the loop
        early (a client gone) takes the choices out of the step loop and
        frees their branches."""
        if not tokens:
            raise ApiError("the prompt is empty", param="prompt")
        if len(tokens) >= self.ctx.n_ctx:
            if not self.ctx_shift:
                raise _too_long(len(tokens), self.ctx.n_ctx)
            self.metrics.context_shifts += 1
            tokens = self.fit(tokens)
        room = self.ctx.n_ctx - len(tokens)
        if room < 1:
            raise _too_long(len(tokens), self.ctx.n_ctx)
        # With context shift a reply may pass the context's end.
        limit = (gen.max_tokens or room) if self.ctx_shift else min(gen.max_tokens or room, room)
        self.metrics.prompt_tokens += len(tokens)
        prompt_in = asyncio.Event()
        self._prefilling.add(prompt_in)
        try:
            branches, reused = await self._branches(tokens, gen)
        finally:
            self._prefilling.discard(prompt_in)
            prompt_in.set()
        # The prompts still being prefilled now: this request starts with them.
        together = list(self._prefilling)
        cached: int | None = reused
        events: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        choices: list[Choice] = []
        try:
            for i, b in enumerate(branches):
                if grammar is not None:
                    b.set_grammar(grammar)
                c = Choice(self.ctx, self.metrics, i, b, gen, limit, len(tokens), events, ending)
                thinks = c.budget is not None
                c.drafts = drafting(tokens, gen, grammar, thinks, self.spec_k, self.draft)
                choices.append(c)
            if together:
                await asyncio.gather(*(e.wait() for e in together))
            await self._start(choices)
            finished = 0
            while finished < len(choices):
                event = await events.get()
                if event.finish == "error":
                    raise ApiError(event.text, status=500, kind="server_error")
                if event.finish is not None:
                    finished += 1
                if cached is not None:
                    event, cached = dataclasses.replace(event, cached=cached), None
                yield event
        finally:
            for c in choices:
                c.cancelled = True
                if not c.joined:  # the step loop never had it
                    c.released.set()
            self._wake.set()
            for c in choices:
                await c.released.wait()
                if c.drafts is not None:
                    await c.drafts.aclose()
            for i, b in enumerate(branches):
                if b.disposed:
                    continue
                if i == 0 and self.cache is not None and choices and not choices[0].failed:
                    # The prompt and the reply, for the next turn to fork.
                    try:
                        await self.cache.keep(b, [*tokens, *choices[0].committed])
                        continue
                    except (LloyalError, ValueError):
                        pass
                await b.prune()


async def _verify(c: Choice, token: int, guesses: list[int]) -> bool:
    """Decode ``token`` and ``guesses`` into the choice's branch (in the
    step's decode), keep the drafts the model agrees with and send them,
    and choose the next token from the same logits. True when the choice
    ended. Raises, with the branch untouched, when the decode fails (the
    caller commits ``token`` alone instead)."""
    drafts = c.drafts
    assert drafts is not None
    base = c.branch.position
    rows = await c.branch.prefill([token, *guesses], logits="all")
    with c.holding():
        c.committed.append(token)
        kept, ended = 1, False
        try:
            for i in range(len(guesses) + 1):
                choice = drafts.choice(rows[i])
                if c.decide(Produced(choice, "", c.ctx.is_stop_token(choice))) is None:
                    ended = True
                    break
                if i < len(guesses) and choice == guesses[i]:
                    c.committed.append(choice)
                    kept += 1
                    continue
                c.next = choice  # decoded at the next step
                break
            if kept < 1 + len(guesses):
                # The logits after the last kept token: what a commit reads.
                await c.branch.truncate(base + kept, logits=rows[kept - 1])
        except Exception as e:
            c.fail(e)
            ended = True
        accepted = kept - 1
        c.metrics.spec_drafted += len(guesses)
        c.metrics.spec_accepted += accepted
        drafts.k = max(1, min(drafts.k_max, accepted + 1))
        return ended


def _too_long(n: int, n_ctx: int) -> ApiError:
    """OpenAI's error for a prompt over the context (clients key on its code)."""
    return ApiError(
        f"This model's maximum context length is {n_ctx} tokens; the prompt has {n} tokens",
        param="messages",
        code="context_length_exceeded",
    )
