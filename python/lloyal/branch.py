"""Forkable decode state: Branch and BranchStore.

A :class:`Branch` *is* its native object: it subclasses
``_lloyal.NativeBranch``, which owns the branch (dropped unpruned, it gives
the lease back with a ``ResourceWarning``), answers the cheap reads
(``position``, ``parent``, ``logits``...) as typed getters and knows which
object each branch has, so ``parent`` and ``children`` return yours. This
file adds what Python is for: the coroutines, argument checks and the
runnable examples.

Length: :class:`Branch` and :class:`BranchStore` are the two halves of one
concept (a branch's own verbs, and the same verbs for many branches in one
decode); each method is a thin wrapper of one native call with its
documented, runnable example, and the examples are most of the file.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, overload

import anyio
import numpy as np
import numpy.typing as npt

from lloyal import _check, _step
from lloyal import adapters as _adapters
from lloyal._bridge import call_native
from lloyal._generation import Generation
from lloyal._lloyal import BranchSeed, NativeBranch
from lloyal.adapters import Adapters, ControlVector, LoraSpec
from lloyal.context import Base, Context, Logits, _logits_arg, _token_id, _token_list
from lloyal.errors import LloyalError
from lloyal.grammar import Grammar, _compile
from lloyal.media import Media, has_media
from lloyal.sampling import SamplingParams


@dataclass(frozen=True)
class Produced:
    """A token a branch would emit next (nothing written yet)."""

    token: int
    text: str
    is_stop: bool


@dataclass(frozen=True)
class Token:
    """A token a branch committed, with its exact text (see ``TextStream``)."""

    token: int
    text: str


def _check_context(ctx: object) -> None:
    if not isinstance(ctx, Context):
        raise TypeError(f"ctx must be a lloyal.Context, got {type(ctx).__name__}")


def _raise_first(errors: Sequence[BaseException | None] | None) -> None:
    """Raise the first item error of a batched call (``None``: none failed)."""
    for e in errors or ():
        if e is not None:
            raise e


class Branch(NativeBranch):
    """Forkable decode state: a KV sequence plus its own sampler (and random
    stream), logits snapshot, perplexity trackers and logit biases.

    ``fork()`` shares the KV prefix in memory (unified KV: only cell
    metadata is copied) and clones everything else, so siblings diverge
    independently. Commits from concurrent tasks are decoded together.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
    ...         await root.prefill(await ctx.tokenize("The capital of France is"))
    ...         child = await root.fork()
    ...         p = await child.produce()
    ...         await child.commit(p.token)
    ...         return p.text, child.position - root.position
    >>> asyncio.run(main())
    (' Paris', 1)
    """

    __slots__ = ("_ctx", "_up")

    def __init__(self, seed: BranchSeed, ctx: Context, up: Branch | None = None) -> None:
        # The native __new__ took the branch out of `seed`.
        self._ctx = ctx
        # A fork keeps its parent's object alive: a parent you only reach
        # through its children is still in use, not garbage.
        self._up = up
        self._register()

    @classmethod
    def create(
        cls,
        ctx: Context,
        params: SamplingParams | None = None,
        grammar: str | Grammar | None = None,
        *,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        lark: str | None = None,
    ) -> Branch:
        """A new root branch with its own KV lease (empty until ``prefill``),
        optionally constrained by a grammar: GBNF text or a :class:`Grammar`
        (copied) as ``grammar=``, a JSON schema, or a Lark grammar (see
        :mod:`lloyal.grammar`). Forks clone the grammar's state.

        Raises :class:`NoLeaseError` when all ``n_seq_max`` leases are held,
        :class:`GrammarError` for an invalid grammar (and then holds no lease).

        >>> import asyncio, json, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
        ...                   "required": ["ok"], "additionalProperties": False}
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY, json_schema=schema)
        ...         await b.prefill(await ctx.tokenize("JSON:"))
        ...         text = "".join([t.text async for t in b])
        ...         return json.loads(text)["ok"] in (True, False)
        >>> asyncio.run(main())
        True
        """
        _check_context(ctx)
        ctx._check_open()
        compiled = _compile(ctx, grammar, json_schema, lark)
        branch = cls(ctx._native.branch_create(params or SamplingParams()), ctx)
        if compiled is not None:
            branch._set_grammar(compiled._native)
        return branch

    # -- decoding --------------------------------------------------------------

    @overload
    async def prefill(self, tokens: Sequence[int], *, logits: Literal["last"] = "last") -> None: ...
    @overload
    async def prefill(self, tokens: Sequence[int], *, logits: Literal["all"]) -> Rows: ...
    async def prefill(
        self, tokens: Sequence[int], *, logits: Literal["last", "all"] = "last"
    ) -> Rows | None:
        """Decode ``tokens`` into this branch and keep the last logits. Does
        not accept them (no penalty history, no perplexity).

        ``tokens`` may hold media placeholders (``ctx.tokenize(text,
        media=...)``, see :mod:`lloyal.media`): each medium is encoded and
        decoded at its place, text runs as usual, all or nothing. When the
        prompt ends with a medium the model closes with no text token,
        there are no logits after it: decode some text before ``produce``.

        ``logits="all"`` also returns every position's logits from the same
        decode, a read-only ``(len(tokens), vocab)`` float32 array: row
        ``i`` is the distribution after ``tokens[i]``. One decode then
        verifies a whole draft (speculative decoding) or scores every token
        of a text; it costs a copy of ``vocab`` floats per token.

        >>> import asyncio, lloyal
        >>> import numpy as np
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         tokens = await ctx.tokenize("The capital of France is Paris")
        ...         rows = await b.prefill(tokens, logits="all")
        ...         after_is = ctx.token_to_text(int(np.argmax(rows[-2])))
        ...         return rows.shape == (len(tokens), ctx.vocab_size), after_is
        >>> asyncio.run(main())
        (True, ' Paris')
        """
        all_rows = _logits_mode(logits)
        ids = _token_list(tokens)
        ctx = self._ctx
        ctx._check_open()
        if has_media(ids):
            if all_rows:
                raise ValueError('logits="all" is for text tokens: a medium gives no rows')
            await self._prefill_parts(ctx._media.split(ids))
            return None
        _raise_first(await _step.submit(ctx, [(self, ids)], all_rows))
        return _take_rows(self) if all_rows else None

    async def _prefill_parts(self, parts: list[list[int] | Media]) -> None:
        """Text and media in turn, all or nothing: on an error (or a
        cancel) the branch goes back to where it was, logits included."""
        start = self.position
        try:
            before: Logits | None = np.array(self.logits)
        except ValueError:
            before = None  # no logits yet
        try:
            for part in parts:
                if isinstance(part, Media):
                    await self._encode(part)
                else:
                    _raise_first(await _step.submit(self._ctx, [(self, part)], False))
        except BaseException:
            # Always, not only when the position moved. A cancelled await
            # leaves its job to the worker (an encode runs to its end, a
            # text part is given up): the truncate waits until it is done,
            # or it would find the branch busy, fail, and leave it part-way.
            if not self.disposed:
                with anyio.CancelScope(shield=True), contextlib.suppress(LloyalError, ValueError):
                    await self._settled()
                    await self.truncate(start, before)
            raise

    async def _settled(self) -> None:
        """Return once no operation is in flight on this branch: the tick
        that holds its last one has gone to the worker, and the worker is
        done with it (a cleanup path: it polls)."""
        await _step.sent(self._ctx)
        while self._busy and not self.disposed:  # noqa: ASYNC110 - the flag is the worker's
            await anyio.sleep(0.001)

    async def _encode(self, medium: Media) -> None:
        await call_native(lambda done: self._prefill_media(medium.data, medium.size, done))

    async def truncate(self, position: int, logits: npt.ArrayLike | None = None) -> None:
        """Drop this branch's KV from ``position`` on, so it continues from
        there (``0 <= position <= self.position``): a rejected speculative
        draft, a backtrack. The logits snapshot becomes ``logits`` (the
        distribution after the last kept token, e.g. a row of
        ``prefill(..., logits="all")``) or is cleared, so ``produce`` needs
        a decode first. The sampler's penalty history, the perplexities and
        the grammar are not rewound: truncate what was prefilled, not what
        was committed, when they matter.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         draft = await ctx.tokenize(" Lyon, of course", add_special=False)
        ...         rows = await b.prefill(prompt + draft, logits="all")
        ...         await b.truncate(len(prompt), logits=rows[len(prompt) - 1])
        ...         return b.position == len(prompt), (await b.produce()).text
        >>> asyncio.run(main())
        (True, ' Paris')
        """
        p = _check.integer(position, "position")
        arr = _logits_arg(logits)
        await call_native(lambda done: self._truncate(p, arr, done))

    async def clear_and_reseed(self, sinks: Sequence[int], tail: Sequence[int]) -> None:
        """BlinkKV streaming past ``n_ctx`` for this branch: drop its KV and
        decode ``sinks + tail`` at contiguous positions from 0 (``position``
        becomes ``len(sinks) + len(tail)``; the logits are the tail's last).
        The sampler (penalty history, random stream), grammar, perplexity
        and children are kept. If the decode fails (another sequence holds
        the cells) the branch is left empty and the error is raised.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         tokens = await ctx.tokenize("A long story. " * 20)
        ...         await b.prefill(tokens)
        ...         await b.clear_and_reseed(tokens[:4], tokens[-16:])
        ...         return b.position
        >>> asyncio.run(main())
        20
        """
        s, t = _token_list(sinks), _token_list(tail)
        self._ctx._check_open()
        await call_native(lambda done: self._clear_and_reseed(s, t, done))

    async def fork(
        self, *, clone_logits: bool = True, root: bool = False, at: int | None = None
    ) -> Branch:
        """A child sharing this branch's KV prefix, with a clone of its
        sampler (the random stream continues), logits, metrics and logit
        bias (not its steer). Raises :class:`NoLeaseError` when no lease is free.

        ``clone_logits=False`` leaves the child without a logits snapshot,
        for a child that is prefilled before it samples (its ``produce``
        refuses until then). The snapshot is shared copy-on-write either
        way, so this saves no copy; it makes a stale distribution an error.
        ``root=True`` makes the child a root of its own (not among this
        branch's children), so either may be pruned first: what a cache
        that hands out forks of its entries needs.

        ``at`` forks only the first ``at`` positions (``0 <= at <=
        position``; ``ValueError`` otherwise): a fork and a :meth:`truncate`
        in one operation that copies only the cells kept. Below this
        branch's position the child has no logits (prefill it next); its
        sampler, metrics and grammar are cloned as they are, not rewound.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         root = lloyal.Branch.create(ctx)
        ...         tokens = await ctx.tokenize("One two three four")
        ...         await root.prefill(tokens)
        ...         child = await root.fork(at=2)
        ...         return child.position, root.position == len(tokens)
        >>> asyncio.run(main())
        (2, True)

        The child is made at once, on this thread: only the copy of its KV
        cells is work for the engine's worker, and it is queued ahead of
        anything done with the child next (a prefill of the child can
        follow at once; the copy runs between the rounds of any step in
        progress, or right here when the worker is idle). So a fork never
        waits for a decode. Until the copy has run this branch has a fork
        in flight: more forks of it may follow, any other operation on it
        raises :class:`BranchBusyError`."""
        return self._fork_now(clone_logits=clone_logits, root=root, at=at)

    def _fork_now(
        self, *, clone_logits: bool = True, root: bool = False, at: int | None = None
    ) -> Branch:
        """:meth:`fork`, without a coroutine (it never suspends)."""
        seed = self._fork(at, root, clone_logits)
        return type(self)(seed, self._ctx, None if root else self)

    async def produce(self) -> Produced:
        """Sample the next token from this branch's logits. Writes nothing;
        the random stream advances.

        Cheap samplers (greedy, the default ``top_k=40``) run right here; a
        sampler that sorts or scans the whole vocabulary (``top_k=0`` or
        over 1024, mirostat) or applies a grammar runs on a sampler thread
        of the engine, outside the branches lock, and settles this await
        like a decode does, so the event loop is not stalled: ``top_k=0``
        on Gemma 3's 262k-token vocabulary takes about 9 ms. Meanwhile the
        branch is busy (another operation on it raises
        :class:`BranchBusyError`).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await b.prefill(prompt)
        ...         p = await b.produce()
        ...         best = int(b.top_logprobs(1)[0][0])
        ...         return p.token == best, b.position == len(prompt)  # nothing decoded
        >>> asyncio.run(main())
        (True, True)
        """
        produced = self._produce_now()
        if produced is None:  # a slow sampler: on a sampler thread
            produced = await call_native(self._produce_later)
        token, piece, stop = produced
        return Produced(token, piece.decode("utf-8", errors="replace"), stop)

    async def commit(self, token: int) -> None:
        """Accept ``token`` and decode it. Concurrent commits (``gather``)
        share one ``llama_decode``. On failure the branch is exactly as
        before; cancelling the awaiting task leaves it exactly before or
        exactly after the commit.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=3) as ctx:
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("Once upon a time"))
        ...         a, b = await root.fork(), await root.fork()
        ...         token = (await a.produce()).token
        ...         before = ctx.stats.decode_calls
        ...         await asyncio.gather(a.commit(token), b.commit(token))  # one decode
        ...         return a.position - root.position, ctx.stats.decode_calls - before
        >>> asyncio.run(main())
        (1, 1)
        """
        t = _token_id(token)
        ctx = self._ctx
        ctx._check_open()
        _raise_first(await _step.submit(ctx, [(self, t)]))

    def accept(self, token: int) -> None:
        """Record ``token`` as chosen (penalties, perplexities) without
        decoding it.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         before = b.position
        ...         b.accept((await b.produce()).token)  # in the perplexity, not decoded
        ...         return b.position == before, b.perplexity > 1
        >>> asyncio.run(main())
        (True, True)
        """
        self._accept(_token_id(token))

    async def __aiter__(self) -> AsyncIterator[Token]:
        """Produce and commit until a stop token; yields exact text pieces
        (:class:`lloyal.Generation` without limits)."""
        async for step in Generation(self._ctx).drive(self):
            if step.token is not None:
                yield Token(step.token, step.text)

    async def save(self) -> bytes:
        """Snapshot this branch: its KV cells, logits snapshot and position,
        framed with a model fingerprint and checksum (see
        :meth:`Context.kv_cache_save`). The sampler's state is not saved.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         b = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         snapshot = await b.save()
        ...         await b.prune()
        ...         again = await lloyal.Branch.restore(ctx, snapshot, params=lloyal.GREEDY)
        ...         return (await again.produce()).text
        >>> asyncio.run(main())
        ' Paris'
        """
        return bytes(await call_native(self._save))

    @classmethod
    async def restore(
        cls, ctx: Context, data: bytes, params: SamplingParams | None = None
    ) -> Branch:
        """A new root branch (with its own lease) from :meth:`save` bytes.
        Corrupt or foreign data raises :class:`StateError`.

        (See :meth:`save`.)

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         try:
        ...             await lloyal.Branch.restore(ctx, b"not a branch")
        ...         except lloyal.StateError:
        ...             return "refused"
        >>> asyncio.run(main())
        'refused'
        """
        _check_context(ctx)
        ctx._check_open()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        raw = bytes(data)
        native = ctx._native
        p = params or SamplingParams()
        return cls(await call_native(lambda done: native.branch_restore(raw, p, done)), ctx)

    # -- lifetime --------------------------------------------------------------

    async def prune(self) -> None:
        """Free this branch's KV lease. Refuses (``ValueError``) while it has
        live children: prune them first, or use :meth:`prune_subtree`.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("Hello"))
        ...         child = await root.fork()
        ...         try:
        ...             await root.prune()  # a live child shares its cells
        ...         except ValueError:
        ...             pass
        ...         await child.prune()
        ...         await root.prune()
        ...         return root.disposed, lloyal.BranchStore(ctx).available
        >>> asyncio.run(main())
        (True, 2)
        """
        await self._dispose(cascade=False)

    async def prune_subtree(self) -> None:
        """Prune this branch and every descendant.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=3) as ctx:
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("Hello"))
        ...         kids = [await root.fork(), await root.fork()]
        ...         await root.prune_subtree()
        ...         return [k.disposed for k in kids], lloyal.BranchStore(ctx).available
        >>> asyncio.run(main())
        ([True, True], 3)
        """
        await self._dispose(cascade=True)

    async def _dispose(self, cascade: bool) -> None:
        # Decodes this tick issued go to the worker first (a wait of a
        # checkpoint, shielded: a prune must not be lost to a cancellation);
        # then at once when the worker is idle, else queued behind its work.
        with anyio.CancelScope(shield=True):
            await _step.sent(self._ctx)
        if not self._prune_now(cascade):
            await call_native(lambda done: self._prune(cascade, done))

    async def __aenter__(self) -> Branch:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.disposed and not self._ctx.closed:
            with anyio.CancelScope(shield=True):
                await self.prune_subtree()

    # -- sampling controls -----------------------------------------------------

    def sampler_state(self) -> bytes:
        """Where this branch's sampler is: its random stream's position,
        the penalty history and mirostat's bound (not its parameters).
        :meth:`save` does not include it; a branch moved to another
        process with both draws the same tokens it would have drawn here.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         params = lloyal.SamplingParams(temperature=1.0, seed=5)
        ...         a = lloyal.Branch.create(ctx, params)
        ...         await a.prefill(await ctx.tokenize("Once upon a time"))
        ...         for _ in range(3):  # the random stream moves on
        ...             await a.commit((await a.produce()).token)
        ...         state, saved = a.sampler_state(), await a.save()
        ...         b = await lloyal.Branch.restore(ctx, saved, params)
        ...         b.set_sampler_state(state)
        ...         same = [(await a.produce()).token == (await b.produce()).token
        ...                 for _ in range(5)]
        ...         await a.prune(); await b.prune()
        ...         return all(same)
        >>> asyncio.run(main())
        True
        """
        return bytes(self._sampler_state())

    def set_sampler_state(self, state: bytes) -> None:
        """Continue sampling from :meth:`sampler_state` bytes (of a branch
        with the same parameters). Bad bytes raise ``ValueError`` and change
        nothing.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         params = lloyal.SamplingParams(temperature=1.0, seed=7)
        ...         a = lloyal.Branch.create(ctx, params)
        ...         await a.prefill(await ctx.tokenize("Once upon a time"))
        ...         b = await a.fork()
        ...         b.reseed_sampler(99)
        ...         b.set_sampler_state(a.sampler_state())  # back on a's random stream
        ...         return (await a.produce()).token == (await b.produce()).token
        >>> asyncio.run(main())
        True
        """
        if not isinstance(state, (bytes, bytearray, memoryview)):
            raise TypeError(f"state must be bytes, got {type(state).__name__}")
        self._set_sampler_state(bytes(state))

    def set_grammar(
        self,
        grammar: str | Grammar | None = None,
        *,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        lark: str | None = None,
        triggers: Sequence[str] | None = None,
    ) -> None:
        """Constrain this branch from now on (replacing any grammar), or
        remove the constraint when called with no grammar. The grammar
        starts fresh: it constrains what this branch produces next, not the
        text already in its KV. Children forked earlier keep theirs. With
        ``triggers=``, the grammar is lazy: it applies from the first
        trigger word the branch produces (see :mod:`lloyal.grammar`).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("Is the sky blue? Answer:"))
        ...         b.set_grammar(lark='start: " yes" | " no"')
        ...         return "".join([t.text async for t in b])
        >>> asyncio.run(main()) in (" yes", " no")
        True
        """
        compiled = _compile(self._ctx, grammar, json_schema, lark, triggers)
        self._set_grammar(None if compiled is None else compiled._native)

    def set_adapters(
        self, loras: LoraSpec = None, *, control_vector: ControlVector | None = None
    ) -> None:
        """Decode under these LoRA adapters (with scales) and control vector
        from now on; with no arguments, under the base model. Forks made
        after inherit the set. The KV this branch already holds stays as it
        was computed. See :mod:`lloyal.adapters`.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         b.set_adapters()  # the base model (lloyal.fixtures makes test LoRAs)
        ...         return b.adapters == lloyal.Adapters()
        >>> asyncio.run(main())
        True
        """
        self._set_adapters(*_adapters.split(loras, control_vector))

    @property
    def adapters(self) -> Adapters:
        """The set this branch decodes under (see :meth:`set_adapters`)."""
        return _adapters.adapters(self._adapters)

    def set_logits(self, logits: npt.ArrayLike) -> None:
        """Replace the logits snapshot (e.g. after custom scoring). Entries
        are numbers below +inf, -inf masking a token; a NaN or +inf is a
        ``ValueError`` (samplers would pick an arbitrary token).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         logits = b.logits.copy()
        ...         logits[:] = -float("inf")
        ...         logits[42] = 0.0  # only token 42 is left
        ...         b.set_logits(logits)
        ...         return (await b.produce()).token
        >>> asyncio.run(main())
        42
        """
        arr = _logits_arg(logits)
        assert arr is not None
        self._set_logits(arr)

    def steer(self, biases: Mapping[int, float]) -> None:
        """Biases for this branch only (forks do not inherit them).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         paris = (await b.produce()).token
        ...         b.steer({paris: -100.0})  # this branch only, this step only
        ...         return (await b.produce()).token != paris
        >>> asyncio.run(main())
        True
        """
        self._steer(_biases(biases))

    def set_logit_bias(self, biases: Mapping[int, float]) -> None:
        """Biases added before sampling, inherited by forks.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         paris = (await b.produce()).token
        ...         b.set_logit_bias({paris: -100.0})
        ...         child = await b.fork()  # inherits the bias
        ...         return (await child.produce()).token != paris
        >>> asyncio.run(main())
        True
        """
        self._set_logit_bias(_biases(biases))

    def top_logprobs(self, k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float64]]:
        """The ``k`` most likely next tokens under the model's distribution
        (the raw logits snapshot), best first (ties: lower id first), and
        their log-probabilities in nats: ``(tokens, logprobs)``, two arrays
        of ``min(k, vocab)`` entries. Computed natively in one pass with the
        log-sum-exp the worker already summed: no copy of the logits row.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         tokens, logprobs = b.top_logprobs(3)
        ...         best = ctx.token_to_text(int(tokens[0]))
        ...         return best, bool(logprobs[0] >= logprobs[1] >= logprobs[2])
        >>> asyncio.run(main())
        (' Paris', True)
        """
        n = _check.integer(k, "k")
        if n < 0:
            raise ValueError(f"k must be >= 0, got {n}")
        return self._top_logprobs(n)

    def logprobs(self, tokens: Sequence[int]) -> npt.NDArray[np.float64]:
        """Log-probabilities in nats of ``tokens`` as the next token under
        the model's distribution (the raw logits snapshot), one per token.
        ``-model_surprisal(t)`` for each, in one call.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         paris = (await b.produce()).token
        ...         lp = b.logprobs([paris, 0])
        ...         return bool(lp[0] > lp[1]), bool(abs(lp[0] + b.model_surprisal(paris)) < 1e-9)
        >>> asyncio.run(main())
        (True, True)
        """
        return self._logprobs(_token_list(tokens))

    def model_surprisal(self, token: int, base: Base = "nats") -> float:
        """How surprising ``token`` is as the next token under the model's
        distribution (the raw logits snapshot): ``-log p``, in nats or
        bits.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await b.prefill(await ctx.tokenize("The capital of France is"))
        ...         paris = (await b.produce()).token
        ...         nats, bits = b.model_surprisal(paris), b.model_surprisal(paris, "bits")
        ...         return bool(abs(bits * 0.6931471805599453 - nats) < 1e-9)
        >>> asyncio.run(main())
        True
        """
        return self._surprisal(_token_id(token), base)

    def __repr__(self) -> str:
        try:
            return f"<lloyal.Branch position={self.position} children={len(self.children)}>"
        except LloyalError:
            return "<lloyal.Branch disposed>"


Rows = npt.NDArray[np.float32]
"""Per-position logits: ``(n, vocab)`` float32, read-only."""


@dataclass(frozen=True)
class TokenTree:
    """What :meth:`BranchStore.prefill_tree` returns."""

    rows: Rows
    """``(n, vocab)``: row ``j`` is the next-token logits after node ``j``."""
    parents: tuple[int, ...]
    """The tree as given: node ``j`` follows ``parents[j]`` (``-1``: the root)."""
    leaves: tuple[int, ...]
    """The leaf nodes (nodes without children), in node order."""
    branches: tuple[Branch, ...]
    """One branch per leaf, holding the path from the root to it;
    ``branches[0]`` is the root branch itself."""

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to ``node``."""
        _check.integer(node, "node")
        if not 0 <= node < len(self.parents):
            raise IndexError(f"node must be in [0, {len(self.parents)}), got {node}")
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def branch_of(self, node: int) -> Branch:
        """The branch of the first leaf whose path holds ``node``: truncate
        it to ``root position + len(path(node))`` to keep a path ending at
        ``node``."""
        for leaf, branch in zip(self.leaves, self.branches, strict=True):
            if node in self.path(leaf):
                return branch
        raise IndexError(f"node must be in [0, {len(self.parents)}), got {node}")


def _logits_mode(logits: object) -> bool:
    if logits not in ("last", "all"):
        raise ValueError(f'logits must be "last" or "all", got {logits!r}')
    return logits == "all"


def _take_rows(branch: NativeBranch) -> Rows:
    rows: Rows | None = branch._take_rows()
    if rows is None:  # taken by a concurrent prefill of the same branch
        raise RuntimeError("the rows of this prefill were already taken")
    return rows


def _biases(biases: Mapping[int, float]) -> list[tuple[int, float]]:
    if not isinstance(biases, Mapping):
        raise TypeError(
            f"biases must be a mapping of token id to bias, got {type(biases).__name__}"
        )
    return [(_token_id(t), float(b)) for t, b in biases.items()]


class BranchStore:
    """Continuous tree batching: many branches, one ``llama_decode``.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         store = lloyal.BranchStore(ctx)
    ...         root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
    ...         await root.prefill(await ctx.tokenize("Once upon a time"))
    ...         kids = [await root.fork() for _ in range(3)]
    ...         before = ctx.stats.decode_calls
    ...         await store.commit([(k, (await k.produce()).token) for k in kids])
    ...         return ctx.stats.decode_calls - before, store.available
    >>> asyncio.run(main())
    (1, 0)
    """

    def __init__(self, ctx: Context) -> None:
        _check_context(ctx)
        self._ctx = ctx

    def _own(self, branch: Branch, what: str) -> Branch:
        """`branch`, after checking it is a Branch of this store's context
        (before anything runs: a bad item changes nothing)."""
        if not isinstance(branch, Branch):
            raise TypeError(f"{what} must be a lloyal.Branch, got {type(branch).__name__}")
        if branch._ctx is not self._ctx:
            raise ValueError(f"{what} belongs to another context than this BranchStore's")
        return branch

    def _pairs(self, items: Sequence[tuple[Branch, Any]], what: str) -> list[tuple[Branch, Any]]:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(f"items must be a sequence of (Branch, {what}) pairs")
        pairs = []
        for i, item in enumerate(items):
            if not isinstance(item, tuple) or len(item) != 2:
                raise TypeError(f"items[{i}] must be a (Branch, {what}) pair, got {item!r}")
            pairs.append(item)
        return pairs

    @overload
    async def commit(
        self, items: Sequence[tuple[Branch, int]], *, return_exceptions: Literal[False] = False
    ) -> None: ...
    @overload
    async def commit(
        self, items: Sequence[tuple[Branch, int]], *, return_exceptions: Literal[True]
    ) -> list[Exception | None]: ...
    async def commit(
        self, items: Sequence[tuple[Branch, int]], *, return_exceptions: bool = False
    ) -> list[Exception | None] | None:
        """Accept and decode one token per branch, in one ``llama_decode``
        (more only past ``n_batch`` branches, or when the branches decode
        under different adapter sets: ``docs/batching.md``). Items that fail alone (a
        pruned branch) do not stop the others; the first such error is
        raised after the rest are committed, or, with
        ``return_exceptions=True``, each item's outcome is returned in
        order (``None``: committed; the error: that branch is as it was).
        When the tokens do not fit the KV cache, every branch is left as it
        was and :class:`KVCacheFullError` is raised either way.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         store = lloyal.BranchStore(ctx)
        ...         a = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await store.prefill([(a, await ctx.tokenize("Hello")),
        ...                              (b, await ctx.tokenize("One, two, three,"))])
        ...         start = (a.position, b.position)
        ...         pa, pb = await store.produce([a, b])
        ...         before = ctx.stats.decode_calls
        ...         await store.commit([(a, pa.token), (b, pb.token)])
        ...         moved = (a.position - start[0], b.position - start[1])
        ...         return ctx.stats.decode_calls - before, moved
        >>> asyncio.run(main())
        (1, (1, 1))
        """
        pairs: list[_step.Item] = [
            (self._own(b, f"items[{i}][0]"), _token_id(t))
            for i, (b, t) in enumerate(self._pairs(items, "token"))
        ]
        errors = await _step.submit(self._ctx, pairs)
        if not return_exceptions:
            _raise_first(errors)
            return None
        out: list[Exception | None] = []
        for e in errors or [None] * len(pairs):
            if e is not None and not isinstance(e, Exception):
                raise e
            out.append(e)
        return out

    @overload
    async def produce(
        self, branches: Sequence[Branch], *, return_exceptions: Literal[False] = False
    ) -> list[Produced]: ...
    @overload
    async def produce(
        self, branches: Sequence[Branch], *, return_exceptions: Literal[True]
    ) -> list[Produced | LloyalError]: ...
    async def produce(
        self, branches: Sequence[Branch], *, return_exceptions: bool = False
    ) -> list[Produced] | list[Produced | LloyalError]:
        """:meth:`Branch.produce` for every branch in one native call, in
        order. Cheap samplers run at once; slow ones (grammar masks,
        whole-vocabulary sorts) run in parallel on the engine's sampler
        threads, off the event loop. A branch that fails (a grammar that
        cannot continue, a disposed branch) fails alone: its error is
        raised after the others are chosen, or put in its place with
        ``return_exceptions=True``.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("The capital of France is"))
        ...         kids = [await root.fork() for _ in range(3)]
        ...         store = lloyal.BranchStore(ctx)
        ...         picks = await store.produce(kids)
        ...         await store.commit([(k, p.token) for k, p in zip(kids, picks)])
        ...         same = {p.token for p in picks} == {picks[0].token}  # greedy
        ...         return same, kids[2].position == root.position + 1
        >>> asyncio.run(main())
        (True, True)
        """
        own = [self._own(b, f"branches[{i}]") for i, b in enumerate(branches)]
        native = self._ctx._native
        results = await call_native(lambda done: native.branch_produce_many(own, done))
        out: list[Produced | LloyalError] = []
        for r in results:
            if isinstance(r, BaseException):
                if not return_exceptions or not isinstance(r, LloyalError):
                    raise r
                out.append(r)
            else:
                token, piece, stop = r
                out.append(Produced(token, piece.decode("utf-8", errors="replace"), stop))
        return out

    def logprobs(
        self, items: Sequence[tuple[Branch, int]], *, top: int = 0
    ) -> list[tuple[float, list[int], list[float]]]:
        """For each ``(branch, token)``: the log-probability in nats of
        ``token`` as the branch's next token (its raw logits snapshot) and
        its ``top`` most likely tokens with theirs, best first: ``(logprob,
        tokens, logprobs)``. One native call for all of them, without a copy
        of any logits row (what a server reports for a step's ``logprobs``).
        ``ValueError`` for a token outside the vocabulary or a branch
        without logits.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         a = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await a.prefill(await ctx.tokenize("The capital of France is"))
        ...         b = await a.fork()
        ...         best = int(a.top_logprobs(1)[0][0])
        ...         (lp, ids, lps), _ = lloyal.BranchStore(ctx).logprobs([(a, best), (b, 0)], top=2)
        ...         return ids[0] == best and lp == lps[0] and len(ids) == 2
        >>> asyncio.run(main())
        True
        """
        k = _check.integer(top, "top")
        if k < 0:
            raise ValueError(f"top must be >= 0, got {k}")
        pairs = [(self._own(b, f"items[{i}][0]"), _token_id(t)) for i, (b, t) in enumerate(items)]
        return self._ctx._native.branch_logprobs_many(pairs, k)

    @overload
    async def prefill(
        self, items: Sequence[tuple[Branch, Sequence[int]]], *, logits: Literal["last"] = "last"
    ) -> None: ...
    @overload
    async def prefill(
        self, items: Sequence[tuple[Branch, Sequence[int]]], *, logits: Literal["all"]
    ) -> list[Rows]: ...
    async def prefill(
        self,
        items: Sequence[tuple[Branch, Sequence[int]]],
        *,
        logits: Literal["last", "all"] = "last",
    ) -> list[Rows] | None:
        """Decode a token list into each branch, packed into
        ``ceil(total / n_batch)`` decodes (long lists are split).
        ``logits="all"`` returns each item's per-position logits (see
        :meth:`Branch.prefill`), in item order. Like :meth:`commit`, all or
        nothing on :class:`KVCacheFullError`.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         a = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         short = await ctx.tokenize("Hello")
        ...         long = await ctx.tokenize("One, two, three, four, five,")
        ...         before = ctx.stats.decode_calls
        ...         await lloyal.BranchStore(ctx).prefill([(a, short), (b, long)])
        ...         fits = (a.position, b.position) == (len(short), len(long))
        ...         return ctx.stats.decode_calls - before, fits
        >>> asyncio.run(main())
        (1, True)
        """
        all_rows = _logits_mode(logits)
        pairs: list[_step.Item] = [
            (self._own(b, f"items[{i}][0]"), _token_list(t))
            for i, (b, t) in enumerate(self._pairs(items, "tokens"))
        ]
        _raise_first(await _step.submit(self._ctx, pairs, all_rows))
        return [_take_rows(b) for b, _ in pairs] if all_rows else None

    async def prefill_tree(
        self, root: Branch, tokens: Sequence[int], parents: Sequence[int]
    ) -> TokenTree:
        """Decode a tree of tokens after ``root`` in one pass (tree
        attention) and return every node's logits.

        Node ``j`` is ``tokens[j]``, following node ``parents[j]`` (``-1``:
        it follows the root's last token; parents come before children).
        It sits at position ``root.position + depth``. A prefix several
        leaves share is decoded once, its KV cells shared by their
        sequences, so the decode holds ``len(tokens)`` tokens however many
        paths the tree has: one call verifies several speculative
        continuations, or scores the top-k alternatives at several depths.

        Each leaf ends up in a branch holding its path: ``root`` carries the
        first leaf, every other leaf gets a new branch (a lease each; they
        are roots, not ``root``'s children, so prune any of them in any
        order). Sampler state, grammar and perplexity are untouched, as with
        :meth:`Branch.prefill`; each branch's ``logits`` are its leaf's row.
        Raises :class:`NoLeaseError` (nothing decoded) when fewer than
        ``leaves - 1`` leases are free, ``ValueError`` for a malformed tree.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("The capital of France is"))
        ...         paris, london = ctx.tokenize_sync(" Paris"), ctx.tokenize_sync(" London")
        ...         # node 0: " Paris", node 1: " London", both after the prompt
        ...         tree = await lloyal.BranchStore(ctx).prefill_tree(
        ...             root, [paris[0], london[0]], [-1, -1])
        ...         a, b = tree.branches
        ...         out = (tree.rows.shape[0], tree.leaves, a.position == b.position)
        ...         await b.prune()
        ...         await a.prune()
        ...         return out
        >>> asyncio.run(main())
        (2, (0, 1), True)
        """
        self._own(root, "root")
        toks = _token_list(tokens)
        if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence):
            raise TypeError("parents must be a sequence of ints")
        pars = [_check.integer(p, f"parents[{i}]") for i, p in enumerate(parents)]
        native = self._ctx._native
        # The new leaves come as seeds: a cancelled wait drops them, and
        # with them their branches (their leases come back).
        leaves, rows = await call_native(
            lambda done: native.branch_prefill_tree(root, toks, pars, done)
        )
        rows.flags.writeable = False
        branches = tuple(root if s is None else type(root)(s, self._ctx) for _, s in leaves)
        return TokenTree(rows, tuple(pars), tuple(j for j, _ in leaves), branches)

    async def retain_only(self, winner: Branch) -> None:
        """Keep ``winner``'s KV and prune every other branch (one pass over
        the cache). ``winner`` becomes a root.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         store = lloyal.BranchStore(ctx)
        ...         root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await root.prefill(await ctx.tokenize("Once upon a time"))
        ...         kids = [await root.fork() for _ in range(3)]
        ...         await store.retain_only(kids[1])
        ...         return kids[1].parent is None, root.disposed, kids[0].disposed, store.available
        >>> asyncio.run(main())
        (True, True, True, 3)
        """
        self._own(winner, "winner")
        native = self._ctx._native
        await call_native(lambda done: native.branch_retain_only(winner, done))
        winner._up = None

    @property
    def available(self) -> int:
        """KV leases free now: sequences held neither by a branch nor by
        tokens the flat API decoded (a lease never wipes those)."""
        return int(self._ctx._native.leases_available())

    @property
    def cells_held(self) -> int:
        """KV cells the context's branches hold, each shared prefix counted
        once (forks share their parent's cells)."""
        return int(self._ctx._native.branch_cells_held())

    @property
    def kv_pressure(self) -> float:
        """How full the KV cache is with branches: :attr:`cells_held` over
        ``n_ctx`` (0.0 to 1.0). An agent can prune or summarise before a
        decode would raise :class:`KVCacheFullError`."""
        return self.cells_held / self._ctx.n_ctx

    def merge_logits(
        self,
        branches: Sequence[Branch],
        weights: Sequence[float],
        *,
        into: Branch | None = None,
    ) -> None:
        """Set ``into``'s logits snapshot (default ``branches[0]``) to the
        weighted sum of the branches' snapshots, so its next ``produce``
        samples from the mix. Contrastive decoding and classifier-free
        guidance are such sums: with a prompted branch ``cond`` and an
        unprompted ``uncond``, guidance scale ``g`` is weights
        ``[g, 1 - g]`` (``uncond + g * (cond - uncond)``). The sum is taken in
        float64 and rounded once; a token any branch masks (-inf) stays
        masked, and a sum that overflows float32 is a ``ValueError``.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         store = lloyal.BranchStore(ctx)
        ...         cond = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         uncond = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await store.prefill([
        ...             (cond, await ctx.tokenize("A poem about the sea:")),
        ...             (uncond, await ctx.tokenize("A poem:")),
        ...         ])
        ...         store.merge_logits([cond, uncond], [1.5, -0.5])
        ...         return (await cond.produce()).token >= 0
        >>> asyncio.run(main())
        True
        """
        if not branches or len(branches) != len(weights):
            raise ValueError("give one weight per branch, and at least one branch")
        pairs = list(zip(branches, weights, strict=True))
        mixed: npt.NDArray[np.float64] | None = None
        masked: npt.NDArray[np.bool_] | None = None
        for branch, weight in pairs:
            self._own(branch, "branch")
            w = float(weight)
            if not np.isfinite(w):
                raise ValueError(f"weights must be finite, got {weight!r}")
            rows = branch.logits.astype(np.float64)
            # A token one branch masks (-inf) stays masked: a negative
            # weight must not turn it into +inf, nor a zero weight into NaN.
            gone = np.isneginf(rows)
            rows[gone] = 0.0
            if mixed is None or masked is None:
                mixed, masked = rows * w, gone
            else:
                mixed += rows * w
                masked |= gone
        assert mixed is not None
        assert masked is not None
        if np.abs(mixed[~masked]).max(initial=0.0) > np.finfo(np.float32).max:
            raise ValueError("the weighted sum of the logits overflows float32: lower the weights")
        mixed[masked] = -np.inf
        target = into if into is not None else branches[0]
        self._own(target, "into")
        target.set_logits(mixed.astype(np.float32))


__all__ = ["Branch", "BranchStore", "Produced", "Token", "TokenTree"]
