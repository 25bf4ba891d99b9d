""":func:`mcts`: Monte Carlo tree search over tokens, with a scoring function."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import anyio

from lloyal._tasks import gather
from lloyal.context import Context
from lloyal.errors import WorkerLostError
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    Score,
    _check_positive,
    _Output,
    _Recorder,
)
from lloyal.strategies._lanes import Backend, Lane, Pool, backend_of, begin, record
from lloyal.strategies._tree import TreeNode, _frozen, _Node


@dataclass(frozen=True)
class MCTS(_Output):
    """What :func:`mcts` returns: the best-scoring rollout as ``output``
    (with its ``score``), the searched tree (``roots``: the first tokens
    considered, with visit counts and mean values) and the cost.
    :func:`lloyal.cluster.mcts` also counts the iterations abandoned
    because a worker died (``lost``)."""

    output: Continuation
    score: float
    roots: tuple[TreeNode, ...]
    iterations: int
    rollouts: int
    decode_calls: int
    seconds: float
    lost: int = 0


async def mcts(
    ctx: Context | Pool,
    prompt: Prompt,
    score: Score,
    *,
    iterations: int = 8,
    width: int = 2,
    rollout_tokens: int = 16,
    exploration: float = 1.0,
    params: SamplingParams | None = None,
    seed: int = 0,
    stop: Iterable[int] = (),
    parallel: int = 1,
    progress: Progress | None = None,
) -> MCTS:
    """Monte Carlo tree search over tokens, with a scoring function.

    Each iteration walks down the tree by PUCT (mean score plus
    ``exploration`` times the model's probability of the token, discounted
    by visits), expands the leaf into its ``width`` most likely next
    tokens (one decode), rolls each new child out for ``rollout_tokens``
    sampled tokens in lockstep (one decode per step for all of them),
    scores each rollout's text with ``score`` (higher is better; sync or
    async) and backs the scores up the path. Rollout forks are pruned
    straight away; tree nodes keep a branch only while they are leaves.

    ``output`` is the best-scoring rollout seen (the path's tokens plus the
    rollout's).

    ``parallel`` iterations run at once (tree parallelism with virtual
    visits): a running iteration counts as a visit for the others' choices,
    and a node being expanded is not chosen again until it is done, so
    concurrent iterations go down different subtrees and their decodes are
    shared. With ``parallel=1`` the search is deterministic on a
    ``deterministic=True`` context; larger values depend on timing. Needs
    ``iterations * (width - 1) + width + 1 + (parallel - 1) * width`` free
    leases; fewer is a ``ValueError`` before anything runs.

    On a :class:`lloyal.cluster.ContextPool` every worker decodes the prompt
    once (through its prefix cache), the first level of the tree is dealt
    round robin over the workers and each subtree stays on its worker (its
    forks share KV there); with ``parallel=1`` the search is this one, step
    for step. A node whose worker dies is dropped with its subtree
    (``lost`` counts them) and is not chosen again; only when nothing was
    scored is it a :class:`~lloyal.WorkerLostError`.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import mcts
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=8) as ctx:
    ...         return await mcts(ctx, "My favourite colour is", lambda text: -len(text),
    ...                           iterations=2, width=2, rollout_tokens=3)
    >>> result = asyncio.run(main())
    >>> result.iterations, result.rollouts, result.score == -len(result.text)
    (2, 4, True)
    """
    return await _mcts(
        backend_of(ctx),
        prompt,
        score,
        iterations,
        width,
        rollout_tokens,
        exploration,
        params,
        seed,
        stop,
        parallel,
        progress,
    )


async def _mcts(
    backend: Backend,
    prompt: Prompt,
    score: Score,
    iterations: int,
    width: int,
    rollout_tokens: int,
    exploration: float,
    params: SamplingParams | None,
    seed: int,
    stop: Iterable[int],
    parallel: int,
    progress: Progress | None,
) -> MCTS:
    """:func:`mcts` on any backend: the first level of the tree is dealt
    round robin over its workers (each subtree stays on its worker),
    ``parallel`` iterations run at once (virtual visits), and a node whose
    worker dies is dropped with its subtree (counted in ``lost``)."""
    _check_positive(
        iterations=iterations, width=width, rollout_tokens=rollout_tokens, parallel=parallel
    )
    params = params or SamplingParams(temperature=0.8)
    tokens, extra, before, started = await begin(backend, prompt, stop)
    need = iterations * (width - 1) + width + 1 + (parallel - 1) * width
    what = (
        f"mcts(iterations={iterations})"
        if parallel == 1
        else (f"mcts(iterations={iterations}, parallel={parallel})")
    )
    await backend.need_leases(need, what)
    used = backend.workers[: min(width, len(backend.workers))]
    root = _Node(-1, 0.0, 0.0, 0.0)
    best: tuple[float, Continuation] | None = None
    state = {"started": 0, "done": 0, "seeds": 0, "rollouts": 0, "lost": 0}
    changed = [anyio.Event()]  # set when an iteration finishes: selections may change

    async def evaluate(text: str) -> float:
        value = score(text)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    async def backup(node: _Node, rec: _Recorder) -> None:
        """Score ``rec``'s text and add it to ``node`` and its ancestors."""
        nonlocal best
        out = await rec.finish(backend)
        value = await evaluate(out.text)
        walk: _Node | None = node
        while walk is not None:
            walk.visits += 1
            walk.value_sum += value
            walk = walk.parent
        if best is None or value > best[0]:
            best = (value, out)

    def select() -> _Node | None:
        """Down the tree by PUCT: mean score plus ``exploration`` times the
        token's prior, discounted by visits (running iterations count)."""
        node = root
        if not node.open():
            return None
        while node.children and not node.terminal:
            kids = [c for c in node.children if c.open()]
            total = sum(math.exp(c.log_prob - node.log_prob) for c in node.children)
            sqrt_n = math.sqrt(node.visits + node.pending + 1)

            def puct(
                c: _Node, parent: _Node = node, total: float = total, sqrt_n: float = sqrt_n
            ) -> float:
                q = c.value_sum / c.visits if c.visits else 0.0
                prior = math.exp(c.log_prob - parent.log_prob) / total
                return q + exploration * prior * sqrt_n / (1 + c.visits + c.pending)

            node = max(kids, key=puct)
        return node

    def recorder(node: _Node) -> _Recorder:
        rec = _Recorder()
        for n in node.path():
            if not n.terminal:
                rec.add(n.token, n.surprisal, n.entropy)
        rec.stopped = node.terminal
        return rec

    async def expand(leaf: _Node) -> None:
        """Give ``leaf`` its ``width`` most likely children; each non-stop
        child gets a lane, committed onto its token (with its top-k). A
        child whose worker dies is marked dead."""
        assert leaf.branch is not None
        if leaf.top is None:
            leaf.top = await leaf.branch.candidates(width)
        toks, logps, ent, stops = leaf.top
        kids = [
            _Node(t, leaf.log_prob + lp, -lp, ent, parent=leaf, terminal=st or t in extra)
            for t, lp, st in zip(toks[:width], logps[:width], stops[:width], strict=True)
        ]
        live = [k for k in kids if not k.terminal]
        # The root deals its children round robin over its copies, one per
        # worker; any other node keeps them on its own worker. The first
        # child on a worker takes the lane over, the others fork it.
        sources = [leaf.branch, *leaf.spares.values()]
        groups: dict[Lane, list[_Node]] = {}
        for j, kid in enumerate(live):
            groups.setdefault(sources[j % len(sources)], []).append(kid)
        grouped = list(groups.items())
        forked = await gather(
            *(src.fork_many([None] * (len(g) - 1)) for src, g in grouped if len(g) > 1)
        )
        made = iter(forked)
        failure: BaseException | None = None
        for source, group in grouped:  # every fork made is held before any error is raised
            forks = next(made) if len(group) > 1 else []
            if isinstance(forks, BaseException):
                for kid in group:
                    kid.dead = isinstance(forks, WorkerLostError)
                if not isinstance(forks, WorkerLostError):
                    failure = failure or forks
                continue
            group[0].branch = source
            for kid, fork in zip(group[1:], forks, strict=True):
                kid.branch = fork
        if failure is not None:
            leaf.children = kids  # so that the final prune finds their lanes
            raise failure
        leaf.branch, leaf.spares, leaf.children = None, {}, kids  # the kids hold them now
        unused = [src for src in sources if not any(k.branch is src for k in live)]
        await gather(*(src.prune() for src in unused))
        moving = [k for k in live if k.branch is not None]
        # One decode (per worker) moves every child onto its token.
        tops = await gather(*(k.branch.advance(k.token, top=width) for k in moving))
        for kid, outcome in zip(moving, tops, strict=True):
            if isinstance(outcome, WorkerLostError):
                kid.dead = True
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                kid.top = outcome[1]

    async def rollout(kids: list[_Node], base: int) -> list[_Recorder]:
        """Sample a continuation of each kid, in lockstep (one decode per
        step for all of them); kid ``j``'s fork is seeded ``seed + base + j``."""
        recs = [recorder(k) for k in kids]
        forks: list[Lane | None] = [None] * len(kids)

        def lost(j: int, outcome: object) -> bool:
            if isinstance(outcome, WorkerLostError):
                kids[j].dead = True
                return True
            if isinstance(outcome, BaseException):
                raise outcome
            return False

        try:
            todo = [j for j, k in enumerate(kids) if k.branch is not None and not k.dead]
            made = await gather(*(kids[j].branch.fork(seed=seed + base + j) for j in todo))
            for j, fork in zip(todo, made, strict=True):
                if not isinstance(fork, BaseException):  # held before any error is raised
                    forks[j] = fork
            for j, fork in zip(todo, made, strict=True):
                lost(j, fork)
            live = [j for j, f in enumerate(forks) if f is not None]
            produced = await gather(*(_held(forks, j).produce() for j in live))
            for step in range(rollout_tokens):
                going = []
                for j, p in zip(live, produced, strict=True):
                    if lost(j, p):
                        continue
                    if record(recs[j], p, _held(forks, j), extra):
                        going.append(j)
                live = going
                if not live or step + 1 == rollout_tokens:
                    break
                produced = await gather(*(_held(forks, j).step(recs[j].tokens[-1]) for j in live))
        finally:
            with anyio.CancelScope(shield=True):
                await gather(*(f.prune() for f in forks if f is not None))
        return recs

    async def iteration(leaf: _Node) -> None:
        if leaf.terminal or (leaf.branch is None and leaf is not root):
            await backup(leaf, recorder(leaf))
            return
        await expand(leaf)
        kids = leaf.children
        base = state["seeds"]
        state["seeds"] += len(kids)
        recs = await rollout(kids, base)
        for kid, rec in zip(kids, recs, strict=True):
            if kid.dead:  # its worker died: nothing to score
                state["lost"] += 1
                continue
            await backup(kid, rec)
            state["rollouts"] += 1

    async def runner() -> None:
        while state["started"] < iterations:
            leaf = select()
            if leaf is None:
                if state["started"] - state["done"] == 0:
                    return  # nothing open and nothing running: the tree is spent
                await changed[0].wait()
                continue
            state["started"] += 1
            path: list[_Node] = []
            walk: _Node | None = leaf
            while walk is not None:
                path.append(walk)
                walk = walk.parent
            for n in path:
                n.pending += 1
            leaf.busy = True
            try:
                await iteration(leaf)
            except WorkerLostError:  # the leaf's own worker died under it
                leaf.dead = True
                state["lost"] += 1
            finally:
                leaf.busy = False
                for n in path:
                    n.pending -= 1
                state["done"] += 1
                changed[0].set()
                changed[0] = anyio.Event()
                if progress is not None:
                    progress(state["done"], iterations)

    try:
        roots = await backend.roots(tokens, params, used)
        root.branch, root.spares = roots[0], {r.worker: r for r in roots[1:]}
        # One runner's error (or a cancellation) cancels the others before
        # the tree is swept, so that nothing they make afterwards leaks.
        async with anyio.create_task_group() as tg:
            for _ in range(parallel):
                tg.start_soon(runner)
    finally:
        held = [b for n in root.walk() for b in (n.branch, *n.spares.values()) if b is not None]
        await backend.release(held)
    if best is None:
        raise WorkerLostError("every iteration was lost with its worker")
    return MCTS(
        best[1],
        best[0],
        await _frozen(root.children, backend.token_texts),
        state["done"],
        state["rollouts"],
        max(0, await backend.decodes() - before),
        time.perf_counter() - started,
        state["lost"],
    )


def _held(lanes: list[Lane | None], j: int) -> Lane:
    lane = lanes[j]
    assert lane is not None
    return lane
