"""Choosing among given continuations: every choice scored in one decode.

The choices' tokens form a trie after the branch's last token (a prefix that
several choices share is one path); ``BranchStore.prefill_tree`` decodes it
in one pass and returns each node's next-token logits. A choice's score is
the sum of its tokens' log-probabilities: the first from the branch's own
logits, each next one from the row of the node before it. The branch that
holds the chosen path is kept; the others are pruned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore
from lloyal.errors import NoLeaseError

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["choice_logprobs", "choose"]


def log_softmax(row: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """Log-probabilities of one logits row, in float64."""
    x = np.asarray(row, dtype=np.float64)
    top = x.max()
    out: npt.NDArray[np.float64] = x - (top + np.log(np.exp(x - top).sum()))
    return out


def choice_logprobs(first: npt.ArrayLike, rows: npt.ArrayLike, tokens: Sequence[int]) -> float:
    """The log-probability of ``tokens`` after a branch whose next-token
    logits are ``first``, given ``rows[j]``: the logits after ``tokens[j]``
    (scoring a choice alone, from ``prefill(tokens, logits="all")``)."""
    table = np.asarray(rows)
    total = float(log_softmax(first)[tokens[0]])
    for j in range(1, len(tokens)):
        total += float(log_softmax(table[j - 1])[tokens[j]])
    return total


def _trie(sequences: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Tokens and parents of the trie of ``sequences``, and each sequence's
    path of nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}
    paths: list[list[int]] = []
    for seq in sequences:
        node, path = -1, []
        for token in seq:
            key = (node, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = index[key]
            path.append(node)
        paths.append(path)
    return tokens, parents, paths


async def choose(
    ctx: Context, branch: Branch, choices: Sequence[str], *, normalize: bool
) -> tuple[int, list[tuple[float, int]], Branch]:
    """Score ``choices`` after ``branch``; return the index of the best,
    every choice's ``(sum of log-probs, tokens)``, and the branch now
    holding the chosen path (``branch`` itself or a new one)."""
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
        raise ValueError("choices must be a non-empty sequence of strings")
    sequences = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise TypeError(f"choices[{i}] must be a str, got {type(choice).__name__}")
        tokens = ctx.tokenize_sync(choice, add_special=False)
        if not tokens:
            raise ValueError(f"choices[{i}] is empty (no tokens)")
        sequences.append(tokens)
    first = branch.logits.copy()
    store = BranchStore(ctx)
    nodes, parents, paths = _trie(sequences)
    leaves = len(set(range(len(nodes))) - set(parents))
    if leaves - 1 > store.available:
        return await _one_by_one(branch, sequences, first, normalize)
    root_position = branch.position
    try:
        tree = await store.prefill_tree(branch, nodes, parents)
    except NoLeaseError:  # taken meanwhile by another task (nothing was decoded)
        return await _one_by_one(branch, sequences, first, normalize)
    scores = []
    for seq, path in zip(sequences, paths, strict=True):
        total = float(log_softmax(first)[seq[0]])
        for token, node in zip(seq[1:], path[:-1], strict=True):
            total += float(log_softmax(tree.rows[node])[token])
        scores.append((total, len(seq)))
    best = _best(scores, normalize)
    kept = tree.branch_of(paths[best][-1])
    for other in tree.branches:
        if other is not kept and other is not branch:
            await other.prune()
    end = root_position + len(sequences[best])
    if kept.position != end:
        # The choice is a prefix of a longer one: keep the path up to it
        # (with the logits after its last token).
        await kept.truncate(end, tree.rows[paths[best][-1]])
    return best, scores, kept


async def _one_by_one(
    branch: Branch, sequences: list[list[int]], first: npt.NDArray[np.float32], normalize: bool
) -> tuple[int, list[tuple[float, int]], Branch]:
    """Score each choice on ``branch`` itself (no lease needed): decode it,
    read its rows, cut it off again; then decode the best."""
    scores = []
    position = branch.position
    for seq in sequences:
        rows = await branch.prefill(seq, logits="all")
        await branch.truncate(position, first)
        scores.append((choice_logprobs(first, rows, seq), len(seq)))
    best = _best(scores, normalize)
    await branch.prefill(sequences[best])
    return best, scores, branch


def _best(scores: list[tuple[float, int]], normalize: bool) -> int:
    values = [total / n if normalize else total for total, n in scores]
    return int(np.argmax(values))
