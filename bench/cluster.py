"""N lockstep branches locally vs through a lloyal.cluster pool of 1 and 2 actors.

Every configuration runs the same work: N branches forked from one prompt,
greedy, each step one token per branch (produce, then commit), for
``--steps`` steps; aggregate tokens per second, with the ratio to the local
run from the same process. Also printed: the round trip of one trivial
call to an actor (the Ray hop) and of one ``step`` carrying N commits;
and the search strategies (beam search, MCTS sequential and with two
iterations at once) locally and on pools of 1 and 2 actors, in seconds.

    python bench/cluster.py                   # SmolLM2, N = 1, 8
    python bench/cluster.py --n 8,16 --steps 64

On a 2-core machine two actors share the same two cores as one: the
2-actor column shows the hop and the split, not scaling. docs/cluster.md
gives the scaling model for a real cluster from these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from lloyal import cluster, strategies
from lloyal.cluster import ContextPool, RemoteBranch
from lloyal.models import model_path

PROMPT = "Write a list of fruits, one per line:\n"


async def local(model: Path, n: int, steps: int, threads: int) -> float:
    async with await lloyal.create_context(model, n_seq_max=n + 1, n_threads=threads) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize(PROMPT))
        kids = [await root.fork() for _ in range(n)]
        t0 = time.perf_counter()
        for _ in range(steps):
            items = [(b, (await b.produce()).token) for b in kids]
            await store.commit(items)
        seconds = time.perf_counter() - t0
        await root.prune_subtree()
        return n * steps / seconds


async def pooled(model: Path, n: int, steps: int, actors: int, threads: int) -> float:
    options = {"n_seq_max": n + 2, "n_threads": max(1, threads // actors)}
    pool = await ContextPool.start(model, workers=actors, **options)
    try:
        tokens = await pool.workers[0].call("tokenize", PROMPT)
        roots = [await pool.branch(tokens, params=lloyal.GREEDY, worker=w) for w in pool.workers]
        kids: list[RemoteBranch] = []
        for i, root in enumerate(roots):
            kids += await root.fork_many([None] * len(range(i, n, actors)))

        async def run(b: RemoteBranch) -> None:
            p = await b.produce()
            for _ in range(steps):
                p = await b.step(p.token)  # commit and produce: one round trip

        t0 = time.perf_counter()
        await asyncio.gather(*(run(b) for b in kids))
        seconds = time.perf_counter() - t0
        for b in [*kids, *roots]:
            await b.prune()
        return n * steps / seconds
    finally:
        await pool.aclose()


async def hop(model: Path, n: int) -> tuple[float, float]:
    """Median round trip of a trivial call, and of a step with n commits."""
    pool = await ContextPool.start(model, workers=1, n_seq_max=n + 2)
    try:
        w = pool.workers[0]
        trivial = []
        for _ in range(50):
            t0 = time.perf_counter()
            await w.call("load")
            trivial.append(time.perf_counter() - t0)
        tokens = await w.call("tokenize", PROMPT)
        root = await pool.branch(tokens, params=lloyal.GREEDY, worker=w)
        kids = await root.fork_many([None] * n)
        stepped = []
        for _ in range(20):
            made = await asyncio.gather(*(k.produce() for k in kids))
            t0 = time.perf_counter()
            await asyncio.gather(*(k.commit(p.token) for k, p in zip(kids, made, strict=True)))
            stepped.append(time.perf_counter() - t0)
        return statistics.median(trivial), statistics.median(stepped)
    finally:
        await pool.aclose()


SEARCHES = ("beam_search w=4", "mcts", "mcts parallel=2")


def _score(text: str) -> float:
    return -abs(len(text) - 40)


async def searches_local(model: Path, threads: int) -> list[float]:
    """Seconds of each search locally (the same arguments as on the pool)."""
    out = []
    async with await lloyal.create_context(model, n_seq_max=32, n_threads=threads) as ctx:
        t0 = time.perf_counter()
        await strategies.beam_search(ctx, PROMPT, width=4, max_tokens=24)
        out.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await strategies.mcts(ctx, PROMPT, _score, iterations=8, width=2, rollout_tokens=12)
        out.append(time.perf_counter() - t0)
    out.append(float("nan"))  # no local parallel MCTS
    return out


async def searches_pooled(model: Path, actors: int, threads: int) -> list[float]:
    options = {"n_seq_max": 32, "n_threads": max(1, threads // actors)}
    pool = await ContextPool.start(model, workers=actors, **options)
    try:
        out = []
        t0 = time.perf_counter()
        await cluster.beam_search(pool, PROMPT, width=4, max_tokens=24)
        out.append(time.perf_counter() - t0)
        for parallel in (1, 2):
            t0 = time.perf_counter()
            await cluster.mcts(
                pool, PROMPT, _score, iterations=8, width=2, rollout_tokens=12, parallel=parallel
            )
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await pool.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n", default="1,8")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    model = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        here = asyncio.run(local(model, n, args.steps, args.threads))
        one = asyncio.run(pooled(model, n, args.steps, 1, args.threads))
        two = asyncio.run(pooled(model, n, args.steps, 2, args.threads))
        rows.append((n, here, one, two))
        print(
            f"N={n}: local {here:.1f}, 1 actor {one:.1f}, 2 actors {two:.1f} tok/s", file=sys.stderr
        )
    trivial, step = asyncio.run(hop(model, 8))
    searched = [
        asyncio.run(searches_local(model, args.threads)),
        asyncio.run(searches_pooled(model, 1, args.threads)),
        asyncio.run(searches_pooled(model, 2, args.threads)),
    ]
    ray.shutdown()
    print(f"\nmodel: {model.name}; {args.steps} greedy steps; {args.threads} threads in all")
    print("\n| N | local tok/s | 1 actor | ratio | 2 actors | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n, here, one, two in rows:
        print(
            f"| {n} | {here:.1f} | {one:.1f} | {one / here:.2f}x | {two:.1f} | {two / here:.2f}x |"
        )
    print(f"\nround trip: trivial call {trivial * 1e3:.2f} ms; ", end="")
    print(f"a step of 8 commits, their decode included, {step * 1e3:.2f} ms")
    print("\n| search | local s | 1 actor s | ratio | 2 actors s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    here, one, two = searched
    for i, name in enumerate(SEARCHES):
        base = here[i] if here[i] == here[i] else here[i - 1]  # parallel: vs sequential local
        print(
            f"| {name} | {here[i]:.2f} | {one[i]:.2f} | {base / one[i]:.2f}x "
            f"| {two[i]:.2f} | {base / two[i]:.2f}x |"
        )
    print("(ratio: local seconds over pool seconds; above 1 is faster than local)")


if __name__ == "__main__":
    main()
