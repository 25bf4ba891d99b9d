"""Imported by every Python process of ``make test-windows`` (its folder is
on PYTHONPATH there, nowhere else).

Wine 8 loses some socket wake-ups sent from another thread: asyncio's
Proactor loop (Windows' default) then misses a ``call_soon_threadsafe``,
and the selector loop a readable socket, and a loop with no timer pending
sleeps for good. ``scripts/windows/proactor_wakeups.py`` shows it without
lloyal (docs/windows.md). Every loop the suite's processes create through
the event loop policy (``asyncio.run`` and the test plugins do) therefore
keeps a timer pending, so that it looks again within 0.1 s; the loops stay
Proactor loops, what Windows users get.
"""

from __future__ import annotations

import asyncio


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
