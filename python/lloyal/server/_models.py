"""The models a server serves: each opens on first use, and the least
recently used idle one closes when ``models_max`` would be passed or it has
been idle for ``keep_alive`` seconds.

A request holds a *lease* on its model from before its body is handled
until its response has been sent, so a model in use is never closed under
it. A request for a model that is not open waits while another one opens or
until a model is idle enough to close; it is refused only if its model does
not exist (404, OpenAI's ``model_not_found``).

With one model the server keeps today's behaviour: the model opens at
startup, any ``model`` name in a request is that model, and it never closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from lloyal.context import Context, create_context
from lloyal.server._adapters import load as load_adapters
from lloyal.server._protocol import ApiError
from lloyal.server._speculation import check_draft
from lloyal.server._state import ServerConfig, State


async def open_state(config: ServerConfig) -> State:
    """One model's context, adapters and engine, as ``config`` asks."""
    assert config.model_path is not None
    ctx = await _context(config, config.model_path, mmproj=config.mmproj)
    draft: Context | None = None
    try:
        loras = await load_adapters(
            ctx, config.loras, config.control_vector, config.control_vector_layers
        )
        if config.draft_model is not None:
            draft = await _context(config, config.draft_model)
            check_draft(ctx, draft)
    except BaseException:
        if draft is not None:
            await draft.aclose()
        await ctx.aclose()
        raise
    state = State(config, ctx, draft)
    state.engine.loras = loras
    return state


async def _context(
    config: ServerConfig,
    path: str | os.PathLike[str],
    mmproj: str | os.PathLike[str] | None = None,
) -> Context:
    """A generating context on ``path`` sized as ``config`` says."""
    ctx = await create_context(
        path,
        n_ctx=config.n_ctx,
        n_seq_max=config.n_seq_max,
        n_threads=config.n_threads,
        deterministic=config.deterministic,
        mmproj=mmproj,
    )
    return ctx


class _Slot:
    """One model: its config, and its state while open."""

    def __init__(self, name: str, config: ServerConfig) -> None:
        self.name = name
        self.config = config
        self.state: State | None = None
        self.users = 0
        self.last_used = time.monotonic()
        self.loads = 0
        # Bytes it took when last open (None: never opened; see _footprint).
        self.footprint: int | None = None
        # Close it once no request holds it (Ollama's keep_alive: 0).
        self.close_when_idle = False


class Models:
    """The server's models by name (``ServerConfig.served()``).

    >>> import asyncio
    >>> from lloyal.server import ServerConfig
    >>> from lloyal.server._models import Models
    >>> config = ServerConfig(models=(("small", MODEL), ("same", MODEL)), models_max=1)
    >>> async def main():
    ...     models = Models(config)
    ...     await models.start()
    ...     async with models.lease("same") as state:
    ...         print(state.name, models.loaded())
    ...     async with models.lease("small") as state:
    ...         print(state.name, models.loaded())
    ...     await models.aclose()
    >>> asyncio.run(main())
    same ['same']
    small ['small']
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._slots = {name: _Slot(name, c) for name, c in config.served()}
        self.default = next(iter(self._slots))
        self.created = int(time.time())
        # One open or close at a time; also the queue of requests for
        # models that are not open (fair: while one waits for room, others
        # line up behind it rather than pinning the open models forever).
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._released = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def single(self) -> bool:
        return len(self._slots) == 1

    def ids(self) -> list[str]:
        """The models' names (a single model's is its GGUF name unless
        ``model_name`` says otherwise), and whether each is open."""
        return [s.state.name if s.state is not None else s.name for s in self._slots.values()]

    def is_open(self, name: str) -> bool:
        return self._slot(name).state is not None

    def loaded(self) -> list[str]:
        """The names of the open models, least recently used first."""
        slots = (s for s in self._slots.values() if s.state is not None)
        return [s.name for s in sorted(slots, key=lambda s: s.last_used)]

    def states(self) -> dict[str, State]:
        return {s.name: s.state for s in self._slots.values() if s.state is not None}

    def users(self, name: str) -> int:
        """How many requests hold ``name`` now."""
        return self._slot(name).users

    @property
    def waiting(self) -> int:
        """Requests in line for a model to open (or for room to open it)."""
        return self._waiting

    def last_used(self, name: str) -> float:
        """When ``name`` was last used (``time.monotonic()``)."""
        return self._slot(name).last_used

    def loads(self, name: str) -> int:
        """How many times ``name`` has been opened."""
        return self._slot(name).loads

    async def start(self) -> None:
        """Open the one model of a single-model server (so that a bad file
        fails at startup); check that every file of a several-model one
        exists; start the keep-alive sweeper."""
        if self.single:
            await self._open(self._slots[self.default])
        else:
            self._check_files()
        if self.config.keep_alive is not None and not self.single:
            self._sweeper = asyncio.create_task(self._sweep(self.config.keep_alive))

    def _check_files(self) -> None:
        for slot in self._slots.values():
            path = slot.config.model_path
            assert path is not None
            if not Path(path).is_file():
                raise FileNotFoundError(f"model {slot.name!r}: no such file: {path}")

    def _slot(self, name: str | None) -> _Slot:
        if name is None or self.single:
            return self._slots[self.default]
        slot = self._slots.get(name)
        if slot is None:
            raise ApiError(
                f"The model '{name}' does not exist (this server has: {', '.join(self._slots)})",
                status=404,
                param="model",
                code="model_not_found",
            )
        return slot

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[State]:
        """The model ``name`` (None: the default), open, and kept open
        until the block ends."""
        slot = self._slot(name)
        if slot.state is None or self._waiting:
            # Pinned only once it is open: a request waiting in line holds
            # nothing, so a model it wants may close and open again before
            # its turn, but the one ahead of it never waits on it.
            self._waiting += 1
            try:
                async with self._lock:
                    if slot.state is None:
                        await self._make_room(slot)
                        await self._open(slot)
                    slot.users += 1
            finally:
                self._waiting -= 1
        else:
            slot.users += 1
        try:
            slot.last_used = time.monotonic()
            assert slot.state is not None
            yield slot.state
        finally:
            slot.users -= 1
            slot.last_used = time.monotonic()
            self._released.set()
            if slot.close_when_idle and slot.users == 0:
                async with self._lock:
                    if slot.close_when_idle and slot.users == 0:
                        slot.close_when_idle = False
                        await self._close(slot)

    def close_when_idle(self, name: str | None) -> None:
        """Close the model ``name`` as soon as no request holds it (Ollama's
        ``keep_alive: 0``); the next request opens it again."""
        self._slot(name).close_when_idle = True

    def _full(self, slot: _Slot) -> bool:
        """Whether opening ``slot`` would pass ``models_max`` or
        ``models_memory`` (with at least one model open: a model that
        alone passes the budget still opens)."""
        open_slots = [s for s in self._slots.values() if s.state is not None]
        limit, budget = self.config.models_max, self.config.models_memory
        if limit is not None and len(open_slots) >= limit:
            return True
        if budget is None or not open_slots:
            return False
        return sum(map(_footprint, open_slots)) + _footprint(slot) > budget

    async def _make_room(self, slot: _Slot) -> None:
        """Close idle models, least recently used first, until ``slot``
        fits; wait for a model to become idle when none is. Holds the lock."""
        while self._full(slot):
            idle = [s for s in self._slots.values() if s.state is not None and s.users == 0]
            if idle:
                await self._close(min(idle, key=lambda s: s.last_used))
                continue
            self._released.clear()
            await self._released.wait()

    async def _open(self, slot: _Slot) -> None:
        slot.state = await open_state(slot.config)
        slot.loads += 1

    async def _close(self, slot: _Slot) -> None:
        state, slot.state = slot.state, None
        if state is not None:
            slot.footprint = _footprint_of(state)
            await state.aclose()

    async def _sweep(self, keep_alive: float) -> None:
        """Close each model idle for ``keep_alive`` seconds."""
        while True:
            await asyncio.sleep(min(keep_alive, 1.0))
            now = time.monotonic()
            for slot in list(self._slots.values()):
                stale = slot.state is not None and slot.users == 0
                if stale and now - slot.last_used >= keep_alive and not self._lock.locked():
                    async with self._lock:
                        if slot.users == 0 and now - slot.last_used >= keep_alive:
                            await self._close(slot)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for slot in self._slots.values():
            await self._close(slot)


def _footprint_of(state: State) -> int:
    """An open model's bytes: its weights and full-size KV cache, and its
    pooling context's KV if one is open."""
    embedder = state.opened_embedder
    return state.ctx.memory_size + (embedder.memory_size if embedder is not None else 0)


def _footprint(slot: _Slot) -> int:
    """A model's bytes: measured while open, remembered once closed, and
    before it was ever opened its file's size (weights only: the first
    estimate is low by its KV cache)."""
    if slot.state is not None:
        return _footprint_of(slot.state)
    if slot.footprint is not None:
        return slot.footprint
    path = slot.config.model_path
    assert path is not None
    return Path(path).stat().st_size


def models_in(folder: str | os.PathLike[str]) -> tuple[tuple[str, Path], ...]:
    """The GGUF models in ``folder``, named by file stem, projectors
    (``mmproj*``) left out.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> for f in ("b.gguf", "a.gguf", "mmproj-a.gguf", "notes.txt"):
    ...     _ = (d / f).write_bytes(b"")
    >>> [name for name, _ in models_in(d)]
    ['a', 'b']
    """
    files = sorted(Path(folder).glob("*.gguf"))
    return tuple((f.stem, f) for f in files if not f.name.lower().startswith("mmproj"))
