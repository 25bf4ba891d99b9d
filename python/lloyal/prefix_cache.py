"""A prefix cache: decoded prompts kept as branches, reused by forking.

Prompts that share a beginning (a system prompt, a few-shot preamble, a
document asked several questions, the turns of one conversation) need not
decode it again. :class:`PrefixCache` keeps the prompts it served as
branches of their own, indexed by a radix tree of their tokens; a new
prompt forks the entry sharing its longest prefix (a fork copies KV
metadata, not cells), cuts it back to the shared part and prefills only
the rest.

Entries hold KV leases and cells; the least recently used go first when
``max_branches`` or ``max_cells`` would be exceeded, when a lease is
needed and none is free, or when a prompt's prefill finds the KV cache
full (:meth:`PrefixCache.evict_one` gives cells back on demand too).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from lloyal import _radix
from lloyal._radix import Edge
from lloyal._state_file import open_regular, read_head, read_state, write_state
from lloyal.adapters import Adapters, normalized
from lloyal.branch import Branch, BranchStore
from lloyal.context import _token_list
from lloyal.errors import KVCacheFullError, NoLeaseError, StateError
from lloyal.media import whole_media_prefix
from lloyal.sampling import SamplingParams

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["PrefixCache", "PrefixCacheStats"]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache` since it was created.

    ``hit_rate`` is the share of requests that reused at least one token;
    ``saved_tokens`` the tokens not decoded thanks to the cache (of
    ``requested_tokens``); ``prefilled_tokens`` those decoded;
    ``disk_hits`` the requests served by restoring an entry from disk;
    ``disk_write_errors`` the evicted entries that could not be written
    there (each is then just dropped).
    """

    requests: int
    hits: int
    requested_tokens: int
    saved_tokens: int
    prefilled_tokens: int
    evictions: int
    entries: int
    cells: int
    disk_entries: int = 0
    disk_hits: int = 0
    disk_write_errors: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    branch: Branch
    node: Edge[_Entry]
    used: int
    adapters: Adapters


class PrefixCache:
    """Reuse decoded prompt prefixes across requests.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=8) as ctx:
    ...         cache = lloyal.PrefixCache(ctx, max_branches=4)
    ...         system = await ctx.tokenize("You answer questions about geography. " * 8)
    ...         q1 = await ctx.tokenize("Capital of France?", add_special=False)
    ...         q2 = await ctx.tokenize("Capital of Spain?", add_special=False)
    ...         async with await cache.branch(system + q1) as a:
    ...             pass
    ...         async with await cache.branch(system + q2) as b:
    ...             saved = cache.stats.saved_tokens
    ...         await cache.aclose()
    ...         return saved >= len(system)
    >>> asyncio.run(main())
    True

    :meth:`branch` returns a new branch of the caller's (prune it when
    done) holding ``tokens`` with the logits after the last one, ready to
    ``produce``. ``max_branches`` bounds the entries (each holds a lease),
    ``max_cells`` the KV cells all branches of the context may hold before
    entries are evicted (default: no bound but the cache itself). Tasks may
    share one cache: lookups and entry forks take turns; the prefills of
    their suffixes run outside that turn.

    With ``disk_dir``, an evicted entry is written there as a branch state
    file (:meth:`Branch.save`: its KV cells and logits, checksummed) and a
    later request whose longest shared prefix is on disk restores it
    instead of decoding it again (``stats.disk_hits``); the
    ``max_disk_entries`` most recently written are kept. Files are written
    whole or not at all; one that cannot be written is skipped
    (``stats.disk_write_errors``). Only regular files of this cache's
    format whose checksum holds are read (never through a symlink): anything
    else in the folder is a miss, left alone.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        max_branches: int = 16,
        max_cells: int | None = None,
        params: SamplingParams | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        max_disk_entries: int = 64,
    ) -> None:
        if max_branches < 1:
            raise ValueError("max_branches must be at least 1")
        if max_cells is not None and max_cells < 1:
            raise ValueError("max_cells must be at least 1 (or None)")
        self._ctx = ctx
        self._store = BranchStore(ctx)
        self._max_branches = max_branches
        self._max_cells = max_cells
        self._params = params
        # One tree per adapter set: KV computed under one set is no prefix
        # for a prompt under another.
        self._roots: dict[Adapters, Edge[_Entry]] = {}
        self._entries: list[_Entry] = []
        self._by_tokens: dict[tuple[Adapters, tuple[int, ...]], _Entry] = {}
        self._lock = anyio.Lock()
        self._clock = itertools.count(1)
        self._requests = self._hits = self._requested = 0
        self._saved = self._prefilled = self._evictions = 0
        self._disk = Path(disk_dir) if disk_dir is not None else None
        self._max_disk = max(1, max_disk_entries)
        # Prompts on disk, oldest first: tokens -> state file.
        self._on_disk: dict[tuple[int, ...], Path] = {}
        self._disk_hits = self._disk_write_errors = 0
        if self._disk is not None:
            self._disk.mkdir(parents=True, exist_ok=True)
            self._index_disk(self._disk)

    # -- requests ------------------------------------------------------------------

    async def branch(
        self,
        tokens: Sequence[int],
        *,
        params: SamplingParams | None = None,
        remember: bool = True,
        adapters: Adapters | None = None,
    ) -> Branch:
        """A new branch holding ``tokens`` (its logits after the last one),
        decoding only what no cached prompt shares. The prompt is cached
        for later requests (a fork of the new branch becomes its entry).
        Raises :class:`NoLeaseError` when no lease can be freed even by
        evicting every entry.

        With ``remember=False`` nothing is cached now, and the branch is
        ready one fork sooner: hand it back with :meth:`keep` when done with
        it, so that what it holds then (the prompt and the reply, say)
        becomes the entry.

        ``adapters``: the set the branch decodes under (default: the
        context's, :attr:`Context.adapters <lloyal.Context.adapters>`); only
        entries made under the same set are reused."""
        out, _ = await self.branch_reusing(
            tokens, params=params, remember=remember, adapters=adapters
        )
        return out

    async def branch_reusing(
        self,
        tokens: Sequence[int],
        *,
        params: SamplingParams | None = None,
        remember: bool = True,
        adapters: Adapters | None = None,
    ) -> tuple[Branch, int]:
        """:meth:`branch`, and how many of ``tokens`` came from the cache
        rather than being decoded (a server's ``cached_tokens``).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_ctx=512, n_seq_max=4) as ctx:
        ...         cache = lloyal.PrefixCache(ctx)
        ...         ids = await ctx.tokenize("The cat sat on the mat.")
        ...         first, reused = await cache.branch_reusing(ids)
        ...         print(reused)
        ...         again, reused = await cache.branch_reusing(ids + [13])
        ...         print(reused == len(ids))
        ...         await first.prune(); await again.prune(); await cache.aclose()
        >>> asyncio.run(main())
        0
        True
        """
        ids = tuple(_token_list(tokens))
        if not ids:
            raise ValueError("tokens must not be empty")
        self._requests += 1
        self._requested += len(ids)
        p = params or self._params
        wanted = self._ctx.adapters if adapters is None else normalized(adapters)
        out, reuse = await self._start(ids, p, wanted)
        try:
            if p is not None:
                out.set_sampler_params(p)
            await self._prefill(out, ids[reuse:])
        except BaseException:
            await out.prune()
            raise
        self._saved += reuse
        self._prefilled += len(ids) - reuse
        if remember:
            try:
                await self._remember(ids, out)
            except BaseException:
                await out.prune()
                raise
        return out, reuse

    async def keep(self, branch: Branch, tokens: Sequence[int]) -> None:
        """Take ``branch``, which holds exactly ``tokens`` (``ValueError``
        otherwise), as the entry for them: the caller gives it up, and the
        cache prunes it when it is evicted, or at once when those tokens
        have an entry already. Its grammar is removed (a fork of an entry
        starts unconstrained). No fork is made, so this costs no decode
        round: what a server does with a finished request's branch from
        ``branch(..., remember=False)``, whose next turn then shares the
        reply as well as the prompt.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         cache = lloyal.PrefixCache(ctx)
        ...         prompt = await ctx.tokenize("The first turn of a chat. " * 4)
        ...         b = await cache.branch(prompt, remember=False)
        ...         reply = (await b.produce()).token
        ...         await b.commit(reply)
        ...         await cache.keep(b, [*prompt, reply])
        ...         return cache.match([*prompt, reply, 5]) == len(prompt) + 1
        >>> asyncio.run(main())
        True
        """
        ids = tuple(_token_list(tokens))
        if branch.position != len(ids):
            raise ValueError(f"the branch holds {branch.position} tokens, not the {len(ids)} given")
        if not ids:
            await branch.prune()
            return
        branch.set_grammar(None)
        async with self._lock:
            known = self._by_tokens.get((branch.adapters, ids))
            if known is not None:
                known.used = next(self._clock)
            else:
                victims = await self._add(ids, branch)
        if known is not None:
            await branch.prune()
            return
        for victim in victims:
            await self._dispose(victim)

    async def _start(
        self, ids: tuple[int, ...], params: SamplingParams | None, adapters: Adapters
    ) -> tuple[Branch, int]:
        """A new branch holding the longest prefix of ``ids`` an entry has
        (at most all but the last token), and that prefix's length. A fork
        is made at once (its KV copy queued ahead of the prefill that
        follows), so requests do not wait for each other here. When no
        lease is free, entries are evicted, least recently used first."""
        while True:
            async with self._lock:
                root = self._roots.get(adapters, Edge((), None))
                node, matched = _radix.walk(root, ids)
                # Saved states keep no adapter set: the disk serves the base model.
                disk = self._disk is not None and adapters == Adapters()
                if disk and await self._from_disk(ids, matched, params):
                    root = self._roots[adapters]  # made by the restore, if new
                    node, matched = _radix.walk(root, ids)
                source = _radix.any_entry(node) if matched else None
                # At least one token is decoded, for the logits after the
                # last; a medium is reused whole or not at all.
                reuse = min(matched, len(ids) - 1) if source is not None else 0
                reuse = whole_media_prefix(ids, reuse)
                try:
                    if source is None or reuse == 0:
                        fresh = Branch.create(self._ctx, params)
                        fresh.set_adapters(
                            list(adapters.loras), control_vector=adapters.control_vector
                        )
                        return fresh, 0
                    at = reuse if reuse < len(source.tokens) else None
                    out = source.branch._fork_now(clone_logits=False, root=True, at=at)
                except NoLeaseError:
                    victim = self._take(keep=source)
                    if victim is None:
                        raise
                else:
                    source.used = next(self._clock)
                    self._hits += 1
                    return out, reuse
            # Its lease is free once the prune has run: out of the lock, so
            # that other requests need not wait for it.
            await self._dispose(victim)

    async def _prefill(self, branch: Branch, tokens: Sequence[int]) -> None:
        """Prefill ``tokens`` into ``branch``; when the KV cache is full,
        entries give back their cells, least recently used first, until it
        fits (the failed prefill changed nothing)."""
        while True:
            try:
                await branch.prefill(tokens)
                return
            except KVCacheFullError:
                if not await self.evict_one():
                    raise

    async def evict_one(self) -> bool:
        """Prune the least recently used entry (to disk first, with
        ``disk_dir``): its cells and lease come back unless a live branch
        shares them. ``False`` when there is none."""
        async with self._lock:
            victim = self._take()
        if victim is None:
            return False
        await self._dispose(victim)
        return True

    async def _with_lease(
        self, make: Callable[[], Awaitable[Branch]], keep: _Entry | None = None
    ) -> Branch:
        """``make()``, evicting entries (never ``keep``) while no lease is free."""
        while True:
            try:
                return await make()
            except NoLeaseError:
                if not await self._evict_one(keep):
                    raise

    async def _remember(self, ids: tuple[int, ...], branch: Branch) -> None:
        """Keep a fork of ``branch`` as the entry for ``ids`` (made at once:
        nothing here waits for a decode)."""
        async with self._lock:
            known = self._by_tokens.get((branch.adapters, ids))
            if known is not None:
                known.used = next(self._clock)
                return
            # A lease for the fork: the evicted entry's prune must have run.
            while self._store.available == 0 and await self._evict_one():
                pass
            try:
                kept = branch._fork_now(root=True)
            except NoLeaseError:
                return  # every lease is the callers': serve without caching
            victims = await self._add(ids, kept)
        for victim in victims:
            await self._dispose(victim)

    async def _add(self, ids: tuple[int, ...], branch: Branch) -> list[_Entry]:
        """Make ``branch`` the entry for ``ids`` (under the lock). The
        entries ``max_branches`` leaves no room for are taken out and
        returned, for the caller to dispose of once out of the lock;
        ``max_cells`` is enforced here (cells come back only once pruned)."""
        victims: list[_Entry] = []
        while len(self._entries) >= self._max_branches:
            victim = self._take()
            if victim is None:
                break
            victims.append(victim)
        entry = self._enter(ids, branch)
        while (
            self._max_cells is not None
            and self._store.cells_held > self._max_cells
            and await self._evict_one(entry)
        ):
            pass
        return victims

    def _enter(self, ids: tuple[int, ...], branch: Branch) -> _Entry:
        """Index ``branch`` as the entry for ``ids`` under its adapter set."""
        adapters = branch.adapters
        node = _radix.insert(self._roots.setdefault(adapters, Edge((), None)), ids)
        entry = _Entry(ids, branch, node, next(self._clock), adapters)
        node.entry = entry
        self._entries.append(entry)
        self._by_tokens[adapters, ids] = entry
        return entry

    def _unindex(self, entry: _Entry) -> None:
        """Take ``entry`` out of the index (and its set's tree, once empty)."""
        del self._by_tokens[entry.adapters, entry.tokens]
        _radix.remove(entry.node)
        root = self._roots.get(entry.adapters)
        if root is not None and not root.children and root.entry is None:
            del self._roots[entry.adapters]

    def _take(self, keep: _Entry | None = None) -> _Entry | None:
        """Take the least recently used entry other than ``keep`` out of
        the cache (under the lock); ``None`` when there is none. Dispose of
        it with :meth:`_dispose`."""
        candidates = [e for e in self._entries if e is not keep]
        if not candidates:
            return None
        victim = min(candidates, key=lambda e: e.used)
        self._entries.remove(victim)
        self._unindex(victim)
        self._evictions += 1
        return victim

    async def _dispose(self, victim: _Entry) -> None:
        """Prune an entry taken out (to disk first, with ``disk_dir``):
        whatever becomes of the write, its lease comes back."""
        try:
            if (
                self._disk is not None
                and victim.adapters == Adapters()
                and victim.tokens not in self._on_disk
                # Media placeholders mean something in this context only.
                and min(victim.tokens) >= 0
            ):
                await self._to_disk(victim)
        finally:
            await victim.branch.prune()

    async def _evict_one(self, keep: _Entry | None = None) -> bool:
        """Prune the least recently used entry other than ``keep`` now
        (under the lock); ``False`` when there is none."""
        victim = self._take(keep)
        if victim is None:
            return False
        await self._dispose(victim)
        return True

    def _index_disk(self, folder: Path) -> None:
        """Take in the state files an earlier cache left in ``folder``
        (oldest first), reading only their headers. Anything else there
        is ignored: other files, symlinks, FIFOs, folders, old formats."""
        found: list[tuple[int, tuple[int, ...], Path]] = []
        with os.scandir(folder) as items:
            for item in items:
                if not item.name.endswith(".state"):
                    continue
                path = Path(item.path)
                try:
                    if not item.is_file(follow_symlinks=False):
                        continue
                    with open_regular(path) as f:
                        st = os.fstat(f.fileno())
                        tokens, _ = read_head(f, st.st_size)
                except (OSError, StateError):
                    continue
                found.append((st.st_mtime_ns, tokens, path))
        for _, tokens, path in sorted(found, key=lambda t: t[0]):
            self._on_disk[tokens] = path

    async def _to_disk(self, entry: _Entry) -> None:
        """Write ``entry`` to the folder (made again if it was removed). A
        write that fails is counted and skipped: the entry is dropped, as
        without ``disk_dir``."""
        assert self._disk is not None
        state = await entry.branch.save()
        path = self._disk / f"{time.time_ns()}-{len(entry.tokens)}.state"
        try:
            await anyio.to_thread.run_sync(write_state, path, entry.tokens, state)
        except OSError:
            self._disk_write_errors += 1
            return
        self._on_disk[entry.tokens] = path
        while len(self._on_disk) > self._max_disk:
            await _unlink(self._on_disk.pop(next(iter(self._on_disk))))

    async def _from_disk(
        self, ids: tuple[int, ...], matched: int, params: SamplingParams | None
    ) -> bool:
        """Restore the disk entry sharing more of ``ids`` than memory does
        (``matched`` tokens) as a memory entry; whether one was. Its file
        is removed either way."""
        best, shared = None, matched
        for tokens in self._on_disk:
            n = _radix.shared(tokens, ids, 0)
            if n > shared:
                best, shared = tokens, n
        if best is None:
            return False
        path = self._on_disk.pop(best)
        try:
            state = await anyio.to_thread.run_sync(read_state, path, best)
            restored = await self._with_lease(
                lambda: Branch.restore(self._ctx, state, params=params)
            )
        except (OSError, StateError):
            return False  # a damaged or vanished file is a miss, not an error
        finally:
            await _unlink(path)
        while len(self._entries) >= self._max_branches and await self._evict_one():
            pass
        restored.set_adapters()
        self._enter(best, restored)
        self._disk_hits += 1
        return True

    # -- reading and closing ---------------------------------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            requests=self._requests,
            hits=self._hits,
            requested_tokens=self._requested,
            saved_tokens=self._saved,
            prefilled_tokens=self._prefilled,
            evictions=self._evictions,
            entries=len(self._entries),
            cells=self._store.cells_held,
            disk_entries=len(self._on_disk),
            disk_hits=self._disk_hits,
            disk_write_errors=self._disk_write_errors,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: Sequence[int], *, adapters: Adapters | None = None) -> int:
        """How many leading tokens of ``tokens`` a cached entry holds (what
        :meth:`branch` would not decode, but for the last token), under
        ``adapters`` (default: the context's set)."""
        root = self._roots.get(self._ctx.adapters if adapters is None else normalized(adapters))
        if root is None:
            return 0
        node, matched = _radix.walk(root, tuple(_token_list(tokens)))
        return matched if matched and _radix.any_entry(node) is not None else 0

    async def make_room(self, leases: int) -> bool:
        """Evict least recently used entries until ``leases`` leases are
        free (for branches the caller is about to create or fork). Returns
        whether there are that many now."""
        async with self._lock:
            while self._store.available < leases and await self._evict_one():
                pass
            return self._store.available >= leases

    async def clear(self) -> None:
        """Prune every entry (branches handed out are the callers')."""
        async with self._lock:
            while self._entries:
                entry = self._entries.pop()
                self._unindex(entry)
                await entry.branch.prune()

    async def aclose(self) -> None:
        """:meth:`clear`."""
        await self.clear()

    def __repr__(self) -> str:
        s = self.stats
        return f"<PrefixCache entries={s.entries} hit_rate={s.hit_rate:.2f} saved={s.saved_tokens}>"


async def _create(ctx: Context, params: SamplingParams | None) -> Branch:
    return Branch.create(ctx, params)


async def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        await anyio.Path(path).unlink(missing_ok=True)
