"""The radix tree of token sequences behind :class:`lloyal.PrefixCache`:
each node holds the tokens on the edge into it, its children by their
edge's first token, and the cache's entry for the path ending there."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class _Used(Protocol):
    used: int


E = TypeVar("E", bound=_Used)


class Edge(Generic[E]):
    """A radix-tree node: the tokens on the edge into it, its children by
    their edge's first token, and the entry for the path ending here."""

    __slots__ = ("children", "edge", "entry", "parent")

    def __init__(self, edge: tuple[int, ...], parent: Edge[E] | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[int, Edge[E]] = {}
        self.entry: E | None = None


def walk(root: Edge[E], tokens: tuple[int, ...]) -> tuple[Edge[E], int]:
    """The deepest node whose path ``tokens`` starts with (or runs into,
    ending inside its edge), and how many tokens matched."""
    node, at = root, 0
    while at < len(tokens):
        child = node.children.get(tokens[at])
        if child is None:
            break
        n = shared(child.edge, tokens, at)
        at += n
        node = child
        if n < len(child.edge):
            break
    return node, at


def any_entry(node: Edge[E]) -> E | None:
    """The most recently used entry at or below ``node``."""
    best: E | None = None
    stack = [node]
    while stack:
        n = stack.pop()
        if n.entry is not None and (best is None or n.entry.used > best.used):
            best = n.entry
        stack.extend(n.children.values())
    return best


def insert(root: Edge[E], tokens: tuple[int, ...]) -> Edge[E]:
    """The node for ``tokens``, made (splitting an edge) if need be."""
    node, at = root, 0
    while at < len(tokens):
        child = node.children.get(tokens[at])
        if child is None:
            leaf: Edge[E] = Edge(tokens[at:], node)
            node.children[tokens[at]] = leaf
            return leaf
        edge = child.edge
        n = shared(edge, tokens, at)
        if n < len(edge):  # split the edge
            middle: Edge[E] = Edge(edge[:n], node)
            node.children[tokens[at]] = middle
            child.edge = edge[n:]
            child.parent = middle
            middle.children[child.edge[0]] = child
            child = middle
        at += n
        node = child
    return node


def remove(node: Edge[E]) -> None:
    """Take the entry off ``node``; drop empty leaves and merge a node left
    with one child into it."""
    node.entry = None
    while node.parent is not None and node.entry is None and len(node.children) <= 1:
        parent = node.parent
        if not node.children:
            del parent.children[node.edge[0]]
        else:
            (only,) = node.children.values()
            only.edge = node.edge + only.edge
            only.parent = parent
            parent.children[node.edge[0]] = only
        node = parent


def shared(edge: tuple[int, ...], tokens: tuple[int, ...], at: int) -> int:
    """How many of ``edge``'s tokens ``tokens[at:]`` begins with."""
    n = 0
    while n < len(edge) and at + n < len(tokens) and edge[n] == tokens[at + n]:
        n += 1
    return n
