"""Imported by every Python process of ``make test-windows`` (its folder is
on PYTHONPATH there, nowhere else): stand-ins for what Wine 8 lacks, so
that the suite tests lloyal rather than Wine (docs/windows.md).

1. Wine 8 loses some socket wake-ups sent from another thread: asyncio's
   Proactor loop (Windows' default) then misses a ``call_soon_threadsafe``,
   and the selector loop a readable socket, and a loop with no timer
   pending sleeps for good (``scripts/windows/proactor_wakeups.py`` shows
   it without lloyal). Every loop made through the event loop policy
   (``asyncio.run`` and the test plugins do) keeps a timer pending, so it
   looks again within 0.1 s; the loops stay Proactor loops.
2. Wine 8 answers ``WSAIoctl(SIO_BASE_HANDLE)`` and ``SIO_BSP_HANDLE_*``
   with ``WSAEOPNOTSUPP``, which stops trio's I/O manager from starting.
   Wine has no layered service providers, so a socket is its own base
   socket: trio is given that answer instead of the error, and it too
   looks again within 0.1 s (it is woken through a socket as well).
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

# -- 1. a timer always pending ---------------------------------------------------


class _BeatingLoop(asyncio.ProactorEventLoop):  # type: ignore[name-defined,misc,unused-ignore]
    def run_forever(self) -> None:
        handle: asyncio.TimerHandle | None = None

        def beat() -> None:
            nonlocal handle
            handle = self.call_later(0.1, beat)

        beat()
        try:
            super().run_forever()
        finally:
            if handle is not None:
                handle.cancel()


class _Policy(asyncio.WindowsProactorEventLoopPolicy):  # type: ignore[name-defined,misc,unused-ignore]
    _loop_factory = _BeatingLoop


asyncio.set_event_loop_policy(_Policy())

# -- 2. trio's base socket --------------------------------------------------------

_WSAEOPNOTSUPP = 10045
_TRIO_IO = "trio._core._io_windows"


def _patch_trio(module: ModuleType) -> None:
    original = module._get_underlying_socket

    def underlying(sock: Any, *, which: Any = module.WSAIoctls.SIO_BASE_HANDLE) -> Any:
        try:
            return original(sock, which=which)
        except OSError as e:
            if e.winerror != _WSAEOPNOTSUPP:
                raise
            return module._handle(sock.fileno() if hasattr(sock, "fileno") else sock)

    module._get_underlying_socket = underlying
    # trio is woken through a socket too: it looks again within 0.1 s (1.).
    manager = module.WindowsIOManager
    get_events = manager.get_events

    def capped(self: Any, timeout: float) -> Any:
        return get_events(self, min(timeout, 0.1))

    manager.get_events = capped


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch_trio(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _TRIO_IO:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
