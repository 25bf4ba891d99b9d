"""Whether an asyncio loop on this Windows (or Wine) loses the wake-ups
``call_soon_threadsafe`` sends from other threads.

Two threads settle futures the loop awaits, with no timer pending, so a
lost wake-up leaves the loop asleep for good: a watchdog thread then says
after how many settles it stopped. Under Wine 8 the Proactor loop (the
default) stops after some 20,000 (docs/windows.md); nothing in it is
lloyal's; the selector loop stops too, later (after ~64,000). With
``heartbeat`` a timer is always pending, and the loop looks again within
0.1 s. Usage: ``python proactor_wakeups.py [N] [selector] [heartbeat]``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import sys
import threading
import time

settled = 0
last = time.monotonic()


def watchdog() -> None:
    while True:
        time.sleep(5)
        if time.monotonic() - last > 20:
            print(f"lost a wake-up: asleep for 20 s after {settled} settles", flush=True)
            os._exit(3)


def settle(jobs: queue.Queue[tuple[asyncio.AbstractEventLoop, asyncio.Future[int], int]]) -> None:
    while True:
        loop, fut, i = jobs.get()
        if random.random() < 0.5:
            time.sleep(random.random() * 0.0002)
        loop.call_soon_threadsafe(fut.set_result, i)


async def main(n: int, heartbeat: bool) -> None:
    global settled, last
    loop = asyncio.get_running_loop()
    print(type(loop).__name__, "with a heartbeat" if heartbeat else "", flush=True)
    if heartbeat:  # a timer always pending: the loop looks again every 0.1 s

        def beat() -> None:
            loop.call_later(0.1, beat)

        beat()
    slow = 0
    queues: list[queue.Queue[tuple[asyncio.AbstractEventLoop, asyncio.Future[int], int]]]
    queues = [queue.Queue(), queue.Queue()]
    for q in queues:
        threading.Thread(target=settle, args=(q,), daemon=True).start()
    for i in range(n):
        futures = []
        for q in queues[: 1 + i % 2]:
            fut = loop.create_future()
            q.put((loop, fut, i))
            futures.append(fut)
        for fut in futures:
            await fut
        settled += 1
        now = time.monotonic()
        slow += now - last > 0.05
        last = now
    print(f"no wake-up lost for good in {settled} settles; {slow} took over 50 ms", flush=True)


if __name__ == "__main__":
    if "selector" in sys.argv[2:]:
        asyncio.set_event_loop_policy(asyncio.WindowsSelectorEventLoopPolicy())  # type: ignore[attr-defined,unused-ignore]
    threading.Thread(target=watchdog, daemon=True).start()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    asyncio.run(main(n, "heartbeat" in sys.argv[2:]))
