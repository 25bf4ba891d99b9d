"""A CPU context's decode threads adapt to the machine's load when it was
created without ``n_threads`` (``Context.decode_threads``; the decision
rules are unit-tested in ``crates/lloyal-core/src/threads.rs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import lloyal
import pytest

from tests._hang import HANG_GUARD_S, deadline
from tests.conftest import COUNTING

pytestmark = pytest.mark.anyio


async def _decode_some(ctx: lloyal.Context, branch: lloyal.Branch, n: int) -> None:
    for _ in range(n):
        await branch.commit((await branch.produce()).token)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_explicit_thread_count_is_kept(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_threads=1) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The river"))
        await _decode_some(ctx, root, 8)
        assert (ctx.n_threads, ctx.decode_threads) == (1, 1)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to adapt")
@pytest.mark.skipif(
    sys.platform != "linux" or not Path("/proc/thread-self/schedstat").exists(),
    reason="the adaptation reads Linux's per-thread schedstat",
)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_default_threads_drop_on_a_crowded_machine_and_decode_the_same(
    smollm2: Path,
) -> None:
    """With two busy processes per core beside it, the worker waits for a
    core most of the time, so the first ~100 ms of decoding takes a thread
    away, and the greedy tokens are those of that thread count given
    explicitly. (Not a
    timing test: it waits, up to the hang guard, for the kernel's run-queue
    statistics to say the machine is crowded, which two busy processes per
    core make it on any machine.)"""
    cores = os.cpu_count() or 1
    async with await lloyal.create_context(smollm2, n_ctx=512) as ctx:
        assert ctx.decode_threads == ctx.n_threads == cores
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("The history of the city begins"))
        busy = _busy(2 * cores)
        try:
            limit = deadline()
            while ctx.decode_threads == cores:
                assert time.monotonic() < limit, "the decode threads never adapted (hang guard)"
                if root.position > 400:
                    await root.truncate(40)
                await _decode_some(ctx, root, 4)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        assert 1 <= ctx.decode_threads < cores
        # Fewer threads, the same model: a counting prompt's greedy
        # continuation (wide margins) is the explicit thread count's.
        adapted = ctx.decode_threads
        await root.prune()
        counting = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await counting.prefill(await ctx.tokenize(COUNTING["smollm2"]))
        mine = await _greedy(counting, 6)
    async with await lloyal.create_context(smollm2, n_ctx=512, n_threads=adapted) as fixed:
        again = lloyal.Branch.create(fixed, lloyal.GREEDY)
        await again.prefill(await fixed.tokenize(COUNTING["smollm2"]))
        assert await _greedy(again, 6) == mine


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def _greedy(branch: lloyal.Branch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append((await branch.produce()).token)
        await branch.commit(out[-1])
    return out


def test_lloyal_threads_is_the_default_thread_count(smollm2: Path) -> None:
    """``LLOYAL_THREADS`` sets the thread count of a context created without
    ``n_threads``; an explicit ``n_threads`` wins, and a value that is not a
    count is ignored (every core, as unset)."""
    code = (
        "import asyncio, lloyal, sys\n"
        "async def main():\n"
        "    for kw in ({}, {'n_threads': 2}):\n"
        "        async with await lloyal.create_context(sys.argv[1], n_ctx=64, **kw) as c:\n"
        "            print(c.n_threads)\n"
        "asyncio.run(main())\n"
    )

    def counts(value: str | None) -> list[int]:
        env = {k: v for k, v in os.environ.items() if k != "LLOYAL_THREADS"}
        if value is not None:
            env["LLOYAL_THREADS"] = value
        out = subprocess.run(
            [sys.executable, "-c", code, str(smollm2)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=HANG_GUARD_S,
        )
        return [int(x) for x in out.stdout.split()]

    assert counts("1") == [1, 2]
    assert counts("3") == [3, 2]
    every = counts(None)[0]  # every core: what the machine allows
    assert counts("zero") == [every, 2]
    assert counts("0") == [every, 2]
