""":func:`mcts`: Monte Carlo tree search over tokens, with a scoring function."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context
from lloyal.sampling import SamplingParams
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    Score,
    _check_positive,
    _need_leases,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
    _stopper,
)
from lloyal.strategies._tree import TreeNode, _expand, _Node


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
    ctx: Context,
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
    rollout's). Needs ``iterations * (width - 1) + width + 1`` free leases.

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
    _check_positive(iterations=iterations, width=width, rollout_tokens=rollout_tokens)
    params = params or SamplingParams(temperature=0.8)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    store = BranchStore(ctx)
    _need_leases(store, ctx, iterations * (width - 1) + width + 1, f"mcts(iterations={iterations})")
    rng = np.random.default_rng(seed)
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    root = _Node(-1, 0.0, 0.0, 0.0, branch=Branch.create(ctx, params=params))
    top_branch = root.branch
    assert top_branch is not None
    best: tuple[float, Continuation] | None = None
    rollouts = 0

    async def evaluate(text: str) -> float:
        value = score(text)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    def backup(node: _Node | None, value: float) -> None:
        while node is not None:
            node.visits += 1
            node.value_sum += value
            node = node.parent

    def select() -> _Node:
        node = root
        while node.children and not node.terminal:
            total = sum(math.exp(c.log_prob - node.log_prob) for c in node.children)
            sqrt_n = math.sqrt(node.visits + 1)

            def puct(
                c: _Node, parent: _Node = node, total: float = total, sqrt_n: float = sqrt_n
            ) -> float:
                q = c.value_sum / c.visits if c.visits else 0.0
                prior = math.exp(c.log_prob - parent.log_prob) / total
                return q + exploration * prior * sqrt_n / (1 + c.visits)

            node = max(node.children, key=puct)
        return node

    try:
        await top_branch.prefill(tokens)
        for it in range(iterations):
            leaf = select()
            if leaf.terminal or leaf.branch is None:
                path = [n for n in leaf.path() if not n.terminal]
                rec = _Recorder()
                for n in path:
                    rec.add(n.token, n.surprisal, n.entropy)
                rec.stopped = leaf.terminal
                out = await rec.finish(ctx)
                value = await evaluate(out.text)
                backup(leaf, value)
                if best is None or value > best[0]:
                    best = (value, out)
                if progress is not None:
                    progress(it + 1, iterations)
                continue
            items = await _expand(leaf, width, 0.0, rng, is_stop, True)
            if items:
                await store.commit(items)
            # Roll out every new child at once: fork each, sample in lockstep.
            kids = leaf.children
            forks: list[Branch | None] = []
            recs: list[_Recorder] = []
            for j, kid in enumerate(kids):
                rec = _Recorder()
                for n in kid.path():
                    if not n.terminal:
                        rec.add(n.token, n.surprisal, n.entropy)
                rec.stopped = kid.terminal
                recs.append(rec)
                fork = None if kid.branch is None else await kid.branch.fork()
                if fork is not None:
                    fork.reseed_sampler(seed + rollouts + j)
                forks.append(fork)
            for step in range(rollout_tokens):
                commits: list[tuple[Branch, int]] = []
                for fork, rec in zip(forks, recs, strict=True):
                    if fork is None or rec.stopped:
                        continue
                    p = await fork.produce()
                    if p.is_stop or is_stop(p.token):
                        rec.stopped = True
                        continue
                    rec.add(p.token, fork.model_surprisal(p.token), fork.model_entropy())
                    commits.append((fork, p.token))
                if not commits or step + 1 == rollout_tokens:
                    break
                await store.commit(commits)
            # (On an error the final prune_subtree takes the forks too.)
            for fork in forks:
                if fork is not None:
                    await fork.prune()
            for kid, rec in zip(kids, recs, strict=True):
                out = await rec.finish(ctx)
                value = await evaluate(out.text)
                rollouts += 1
                backup(kid, value)
                if best is None or value > best[0]:
                    best = (value, out)
            if progress is not None:
                progress(it + 1, iterations)
    finally:
        await _prune_all(top_branch)
    assert best is not None
    return MCTS(
        best[1],
        best[0],
        tuple(c.freeze(ctx) for c in root.children),
        iterations,
        rollouts,
        ctx.stats.decode_calls - calls,
        time.perf_counter() - started,
    )
