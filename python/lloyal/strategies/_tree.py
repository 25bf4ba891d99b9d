""":func:`sample_tree`: a tree of continuations, one batched decode per
level; and the token-tree nodes it shares with :func:`~lloyal.strategies.mcts`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context
from lloyal.sampling import GREEDY
from lloyal.strategies._common import (
    _F64,
    Continuation,
    Prompt,
    _check_positive,
    _entropy,
    _log_softmax,
    _need_leases,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
    _stopper,
    _top,
)
from lloyal.strategies._lanes import LocalBackend, Top


@dataclass(frozen=True)
class TreeNode:
    """One token in a tree from :func:`sample_tree` or :func:`mcts`.

    ``log_prob`` sums log-probabilities from the root to this node;
    ``surprisal`` and ``entropy`` are this token's. ``visits`` and
    ``value`` (mean score) are filled in by :func:`mcts`.
    """

    token: int
    text: str
    log_prob: float
    surprisal: float
    entropy: float
    children: tuple[TreeNode, ...] = ()
    visits: int = 0
    value: float = 0.0


@dataclass(frozen=True)
class SampledTree(_Output):
    """What :func:`sample_tree` returns: the first level of the tree
    (``roots``), and the best leaf path by ``log_prob`` as ``output``."""

    output: Continuation
    roots: tuple[TreeNode, ...]
    decode_calls: int
    seconds: float

    def paths(self) -> list[tuple[TreeNode, ...]]:
        """Every root-to-leaf path, in tree order."""
        out: list[tuple[TreeNode, ...]] = []

        def walk(node: TreeNode, prefix: tuple[TreeNode, ...]) -> None:
            path = (*prefix, node)
            if not node.children:
                out.append(path)
            for c in node.children:
                walk(c, path)

        for r in self.roots:
            walk(r, ())
        return out


@dataclass(eq=False)
class _Node:
    """A token of a search tree (:func:`sample_tree`, :func:`mcts`).

    ``branch`` (a :class:`~lloyal.Branch` in :func:`sample_tree`, a lane in
    :func:`mcts`) is held by leaves only; the root of an MCTS over several
    workers holds the prompt on the others in ``spares``."""

    token: int
    log_prob: float
    surprisal: float
    entropy: float
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    branch: Any = None
    top: Top | None = None  # its next-token candidates, once known
    terminal: bool = False
    visits: int = 0
    value_sum: float = 0.0
    pending: int = 0  # iterations running below this node (virtual visits)
    busy: bool = False  # being expanded
    dead: bool = False  # its worker died
    spares: dict[Any, Any] = field(default_factory=dict)

    def path(self) -> list[_Node]:
        out: list[_Node] = []
        node: _Node | None = self
        while node is not None and node.token >= 0:
            out.append(node)
            node = node.parent
        return out[::-1]

    def open(self) -> bool:
        """Whether a selection may end at or pass through this node."""
        if self.dead or self.busy:
            return False
        return not self.children or self.terminal or any(c.open() for c in self.children)

    def walk(self) -> list[_Node]:
        """This node and every descendant."""
        out, stack = [], [self]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children)
        return out

    def freeze(self, texts: Mapping[int, str]) -> TreeNode:
        """As a :class:`TreeNode`, with each token's text from ``texts``."""
        return TreeNode(
            self.token,
            texts[self.token],
            self.log_prob,
            self.surprisal,
            self.entropy,
            tuple(c.freeze(texts) for c in self.children),
            self.visits,
            self.value_sum / self.visits if self.visits else 0.0,
        )


async def _frozen(
    roots: Sequence[_Node], token_texts: Callable[[list[int]], Awaitable[list[str]]]
) -> tuple[TreeNode, ...]:
    """``roots`` as :class:`TreeNode` s (their tokens' texts in one call)."""
    ids = sorted({n.token for r in roots for n in r.walk()})
    texts = dict(zip(ids, await token_texts(ids), strict=True))
    return tuple(r.freeze(texts) for r in roots)


def _choose(
    logits: npt.ArrayLike, width: int, temperature: float, rng: np.random.Generator
) -> tuple[list[int], _F64, float]:
    """``width`` distinct next tokens: the most likely ones, or (above
    temperature 0) a sample without replacement (Gumbel top-k)."""
    logp = _log_softmax(logits)
    if temperature <= 0:
        picks = _top(logp, width)
    else:
        keys = logp / temperature + rng.gumbel(size=logp.shape[0])
        picks = _top(keys, width)
    return picks, logp, _entropy(logp)


async def _expand(
    node: _Node,
    width: int,
    temperature: float,
    rng: np.random.Generator,
    is_stop: Callable[[int], bool],
    decode: bool,
) -> list[tuple[Branch, int]]:
    """Add ``width`` children to ``node``. With ``decode``, give each
    non-stop child a branch (the first takes over ``node``'s own, the rest
    fork it) and return the commits that move them onto their tokens."""
    assert node.branch is not None
    picks, logp, ent = _choose(node.branch.logits, width, temperature, rng)
    items: list[tuple[Branch, int]] = []
    for t in picks:
        child = _Node(t, node.log_prob + float(logp[t]), -float(logp[t]), ent, parent=node)
        child.terminal = is_stop(t)
        node.children.append(child)
        if decode and not child.terminal:
            child.branch = await node.branch.fork()
            items.append((child.branch, t))
    if items:
        # The parent's branch is not needed any more: hand it to the first
        # child instead of keeping a fork (saves a lease per expansion).
        first = next(c for c in node.children if c.branch is not None)
        await first.branch.prune()
        first.branch = node.branch
        items[0] = (node.branch, first.token)
        node.branch = None
    return items


async def sample_tree(
    ctx: Context,
    prompt: Prompt,
    *,
    width: int = 2,
    depth: int = 3,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Iterable[int] = (),
) -> SampledTree:
    """Expand a tree of continuations, one batched decode per level.

    Every node gets ``width`` distinct children: the most likely next
    tokens, or above ``temperature`` 0 a sample without replacement. All
    nodes of a level are decoded together (:meth:`BranchStore.commit`), and
    the last level needs no decode, so a tree of depth ``d`` costs the
    prefill plus ``d - 1`` decodes. Stop tokens end their path. ``output``
    is the leaf path with the highest log-probability. Needs
    ``width ** (depth - 1)`` free KV leases.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import sample_tree
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         return await sample_tree(ctx, "The capital of France is", width=2, depth=2)
    >>> tree = asyncio.run(main())
    >>> tree.roots[0].text, len(tree.roots), len(tree.paths()), tree.decode_calls
    (' Paris', 2, 4, 2)
    """
    _check_positive(width=width, depth=depth)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    store = BranchStore(ctx)
    _need_leases(store, ctx, width ** (depth - 1), f"sample_tree(width={width}, depth={depth})")
    rng = np.random.default_rng(seed)
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    root = _Node(-1, 0.0, 0.0, 0.0, branch=Branch.create(ctx, params=GREEDY))
    top_branch = root.branch
    assert top_branch is not None
    try:
        await top_branch.prefill(tokens)
        frontier = [root]
        for level in range(depth):
            items: list[tuple[Branch, int]] = []
            for node in frontier:
                items += await _expand(node, width, temperature, rng, is_stop, level + 1 < depth)
            frontier = [c for n in frontier for c in n.children if c.branch is not None]
            if items:
                await store.commit(items)
    finally:
        await _prune_all(top_branch)
    leaves: list[_Node] = []
    stack = [root]
    while stack:
        n = stack.pop()
        stack.extend(reversed(n.children))
        if not n.children and n is not root:
            leaves.append(n)
    best = max(leaves, key=lambda n: n.log_prob)
    rec = _Recorder()
    for n in best.path():
        if n.terminal:
            rec.stopped = True
        else:
            rec.add(n.token, n.surprisal, n.entropy)
    return SampledTree(
        await rec.finish(ctx),
        await _frozen(root.children, LocalBackend(ctx).token_texts),
        ctx.stats.decode_calls - calls,
        time.perf_counter() - started,
    )
