"""The event loop's wake-up from another thread: a pipe against a socket pair.

lloyal's worker wakes an asyncio loop by writing one byte that the loop
watches with ``add_reader`` (python/lloyal/_bridge.py). It was a pipe; it is
a socket pair (a Unix socket pair here, a loopback TCP pair on Windows),
because Windows' selector loop watches only sockets. This measures what the
change costs: a thread writes one byte, the loop's reader callback reads it
and settles a future, the awaiting coroutine starts the next round, the same
rounds for both mechanisms in one process, taking turns.

    python bench/wakeup.py [--rounds 5] [--wakes 20000]

Printed: microseconds per wake-up for each (min/median/max over the rounds)
and the ratio socket pair / pipe (median, min-max of the rounds' ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable

from _common import spread


def _pipe() -> tuple[int, int, Callable[[], None]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w, lambda: (os.close(r), os.close(w))  # type: ignore[func-returns-value]


def _socketpair() -> tuple[int, int, Callable[[], None]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a.fileno(), b.fileno(), lambda: (a.close(), b.close())  # type: ignore[func-returns-value]


async def _wakes(make: Callable[[], tuple[int, int, Callable[[], None]]], n: int) -> float:
    """Seconds per wake-up: n rounds of (thread writes, loop reads)."""
    loop = asyncio.get_running_loop()
    r, w, close = make()
    asks = threading.Semaphore(0)
    pending: list[asyncio.Future[None]] = []

    def writer() -> None:
        for _ in range(n):
            asks.acquire()
            os.write(w, b"\1")

    def on_readable() -> None:
        os.read(r, 4096)
        pending.pop().set_result(None)

    loop.add_reader(r, on_readable)
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for _ in range(n):
        fut = loop.create_future()
        pending.append(fut)
        asks.release()
        await fut
    took = time.perf_counter() - t0
    loop.remove_reader(r)
    thread.join()
    close()
    return took / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--wakes", type=int, default=20000)
    args = parser.parse_args()
    pipe: list[float] = []
    pair: list[float] = []
    # The same warm-up for both, then the rounds alternate which goes first.
    asyncio.run(_wakes(_pipe, 1000))
    asyncio.run(_wakes(_socketpair, 1000))
    for i in range(args.rounds):
        order = [(_pipe, pipe), (_socketpair, pair)]
        for make, out in order if i % 2 == 0 else reversed(order):
            out.append(asyncio.run(_wakes(make, args.wakes)) * 1e6)
    ratios = [b / a for a, b in zip(pipe, pair, strict=True)]
    print(f"{args.rounds} rounds of {args.wakes} wake-ups, taking turns")
    print(f"pipe:        {min(pipe):.1f} / {sorted(pipe)[len(pipe) // 2]:.1f} / {max(pipe):.1f} us")
    print(f"socket pair: {min(pair):.1f} / {sorted(pair)[len(pair) // 2]:.1f} / {max(pair):.1f} us")
    print(f"socket pair / pipe: {spread(ratios)}")


if __name__ == "__main__":
    main()
