""":func:`speculative_decode`: draft tokens cheaply (a draft model or
:class:`PromptLookup`), verify them in one target decode; with
``width > 1``, verify a tree of drafts."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio
import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore, TokenTree
from lloyal.context import Context
from lloyal.sampling import GREEDY
from lloyal.strategies._common import (
    _F64,
    Continuation,
    Prompt,
    _check_positive,
    _need_leases,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
    _softmax,
    _stopper,
    _top,
)


@dataclass(frozen=True)
class Speculative(_Output):
    """What :func:`speculative_decode` returns.

    ``drafted`` tokens were proposed over ``rounds`` verification rounds and
    ``accepted`` of them kept; each round also yields one token chosen by
    the target itself. ``decode_calls`` counts target decodes (one per
    round), ``draft_decode_calls`` the draft model's (0 for prompt lookup).
    """

    output: Continuation
    rounds: int
    drafted: int
    accepted: int
    decode_calls: int
    draft_decode_calls: int
    seconds: float
    verified: int
    """Tokens the target decoded to verify (pending tokens, drafts and
    tree siblings): ``k + 1`` per round for a chain."""

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, in ``[0, 1]`` (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Output tokens per target decode (plain decoding: 1)."""
        return len(self.output.tokens) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.output.tokens) / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class PromptLookup:
    """A drafter that needs no second model: prompt lookup decoding.

    It finds the latest earlier occurrence of the last ``n`` tokens (``n``
    from ``max_ngram`` down to ``min_ngram``) in the prompt and output so
    far, and proposes the tokens that followed it. It pays off when the
    output repeats its input: summaries, edits, code, extraction.

    >>> PromptLookup().propose([5, 6, 7, 8, 5, 6], 3)
    [7, 8, 5]
    >>> PromptLookup().propose([1, 2, 3], 3)
    []
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("PromptLookup needs 1 <= min_ngram <= max_ngram")

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the
        end of ``history`` (empty when nothing matches)."""
        h = list(history)
        for n in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):
                if h[start : start + n] == tail:
                    return h[start + n : start + n + k]
        return []


class _ModelDrafter:
    """Drafts with a second model on sequence 0 of its own context, with
    the flat API: rejected tokens are rolled back with ``kv_cache_remove``."""

    def __init__(self, ctx: Context, is_stop: Callable[[int], bool]) -> None:
        self.ctx = ctx
        self.is_stop = is_stop
        self.kv: list[int] = []  # the tokens sequence 0 holds

    async def reset(self) -> None:
        # Unconditional: a cancelled decode may still be queued, and removal
        # runs after it (kv_cache_size would be read before it lands).
        await self.ctx.kv_cache_remove(0, 0)
        self.kv = []

    async def propose(
        self,
        history: Sequence[int],
        k: int,
        temperature: float,
        rng: np.random.Generator,
        want_probs: bool = False,
    ) -> tuple[list[int], list[_F64 | None]]:
        """Up to ``k`` drafts and, above temperature 0 or with ``want_probs``,
        the distribution each came from."""
        ctx = self.ctx
        common = _common_prefix(self.kv, history)
        # Re-decode at least the last token: its logits start the draft.
        keep = min(common, len(history) - 1)
        if keep < len(self.kv):
            await ctx.kv_cache_remove(0, keep)
        await ctx.decode(history[keep:], keep)
        self.kv = list(history)
        tokens: list[int] = []
        probs: list[_F64 | None] = []
        for i in range(k):
            if temperature <= 0:
                t = ctx.greedy_sample()
                q = _softmax(ctx.get_logits(), 1.0) if want_probs else None
            else:
                q = _softmax(ctx.get_logits(), temperature)
                t = int(rng.choice(q.shape[0], p=q))
            tokens.append(t)
            probs.append(q)
            if i + 1 == k or self.is_stop(t):
                break
            await ctx.decode([t], len(self.kv))
            self.kv.append(t)
        return tokens, probs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    >>> _common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _same_vocabulary(a: Context, b: Context) -> bool:
    if a.vocab_size != b.vocab_size:
        return False
    step = max(1, a.vocab_size // 97)
    ids = [*range(0, a.vocab_size, step), a.vocab_size - 1]
    return all(
        a.token_bytes(t, render_special=True) == b.token_bytes(t, render_special=True) for t in ids
    )


async def speculative_decode(
    target: Context,
    prompt: Prompt,
    *,
    draft: Context | PromptLookup | None = None,
    k: int = 4,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    stop: Iterable[int] = (),
    adaptive: bool = True,
    width: int = 1,
    confidence: float = 0.8,
) -> Speculative:
    """Speculative decoding: draft up to ``k`` tokens cheaply, verify them
    in one target decode, keep the accepted prefix and one token from the
    target. With ``adaptive`` (the default) a round drafts one token more
    than the previous round accepted (at most ``k``), so a drafter that is
    often wrong costs little more than plain decoding.

    ``draft`` is a second :class:`Context` (a smaller model with the same
    vocabulary; its sequence 0 is used and cleared) or a
    :class:`PromptLookup` (the default: no second model). Each round
    decodes the pending token and the drafts into the target's branch in
    one ``llama_decode`` and reads every position's logits, so
    verification costs ``k + 1`` tokens; the rejected tail is dropped with
    :meth:`Branch.truncate`, and the draft model rolls back its rejected
    tokens with :meth:`Context.kv_cache_remove`.

    **Tree speculation** (``width > 1``, a draft model, temperature 0):
    where the draft model's top token has probability below
    ``confidence``, its next ``width - 1`` candidates join the round as
    siblings of that draft, and the whole tree is verified in the same one
    decode (:meth:`BranchStore.prefill_tree`: shared prefixes are decoded
    once). The longest path whose every token is the target's argmax is
    kept, so a draft that goes wrong at an uncertain position still
    yields the right token there when it was among the candidates. Each
    sibling holds a lease during the decode; with fewer free leases the
    round uses fewer siblings.

    At ``temperature=0`` a draft is accepted when it is the target's argmax,
    so the output is the target's greedy output, up to how its logits move
    with the decode layout: exactly, with ``create_context(...,
    deterministic=True)`` (docs/determinism.md), else up to near-ties. Above
    0 it uses the speculative sampling rule (accept with probability
    ``min(1, p/q)``, otherwise resample from ``max(p - q, 0)``), which
    samples exactly from the target's softmax at that temperature (no
    top-k/top-p filters).

    One round costs one target decode of ``k + 1`` tokens (plus the
    siblings) and, with a draft model, ``k`` small draft decodes. It is a
    win when a decode of ``k + 1`` tokens costs little more than one
    (memory-bound decoding: GPUs, large models) and drafts are often
    right; measure on your hardware (``bench/speculative.py``).

    It uses one KV lease of the target context; other branches are left
    alone.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import speculative_decode
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         prompt = "1, 2, 3, " * 4 + "1, 2"
    ...         return await speculative_decode(ctx, prompt, k=3, max_tokens=8)
    >>> result = asyncio.run(main())
    >>> result.text, result.rounds, result.decode_calls, result.acceptance_rate
    (', 3, 1, ', 2, 3, 1.0)
    """
    _check_positive(k=k, max_tokens=max_tokens, width=width)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if draft is target:
        raise ValueError("the draft must be a different context from the target")
    if width > 1 and (temperature > 0 or not isinstance(draft, Context)):
        raise ValueError(
            "tree speculation (width > 1) needs a draft model and temperature 0: "
            "its siblings are the draft's top candidates, not samples"
        )
    if not 0.0 <= confidence <= 1.0:
        raise ValueError(f"confidence must be in [0, 1], got {confidence}")
    tokens = await _prompt_tokens(target, prompt)
    is_stop = _stopper(target, stop)
    store = BranchStore(target)
    _need_leases(store, target, 1, f"speculative_decode(k={k})")
    drafter: _ModelDrafter | PromptLookup
    if draft is None or isinstance(draft, PromptLookup):
        drafter = draft or PromptLookup()
    else:
        if not _same_vocabulary(draft, target):
            raise ValueError("the draft and target models have different vocabularies")
        drafter = _ModelDrafter(draft, is_stop)
        await drafter.reset()
    draft_calls = draft.stats.decode_calls if isinstance(draft, Context) else 0
    rng = np.random.default_rng(seed)
    calls, started = target.stats.decode_calls, time.perf_counter()
    history = list(tokens)
    rec = _Recorder()
    rounds = drafted = accepted = verified = 0
    k_now = k
    trunk = Branch.create(target, params=GREEDY)  # holds history[:-1]
    tree: TokenTree | None = None
    try:
        if len(history) > 1:
            await trunk.prefill(history[:-1])
        while len(rec.tokens) < max_tokens and not rec.stopped:
            room = max_tokens - len(rec.tokens) - 1
            qs: list[_F64 | None]
            if room == 0:
                guesses, qs = [], []
            elif isinstance(drafter, PromptLookup):
                guesses = drafter.propose(history, min(k_now, room))
                qs = [None] * len(guesses)
            else:
                guesses, qs = await drafter.propose(
                    history, min(k_now, room), temperature, rng, want_probs=width > 1
                )
            # Node 0 is the pending token, node i + 1 the i-th draft; then
            # the siblings. Row j: the target's distribution after node j.
            nodes, parents = [history[-1], *guesses], list(range(-1, len(guesses)))
            if width > 1:
                _add_siblings(nodes, parents, qs, width, confidence, store.available)
            base = trunk.position  # holds history[:-1]
            tree = await store.prefill_tree(trunk, nodes, parents)
            rows = tree.rows
            rounds += 1
            drafted += len(guesses)
            verified += len(nodes)
            emitted: list[tuple[int, npt.NDArray[np.float32]]] = []
            node = 0  # the last node kept
            if temperature <= 0:
                children: dict[int, list[int]] = {}
                for j, parent in enumerate(parents):
                    children.setdefault(parent, []).append(j)
                while True:
                    choice = int(np.argmax(rows[node]))
                    emitted.append((choice, rows[node]))
                    nxt = next((c for c in children.get(node, ()) if nodes[c] == choice), None)
                    if nxt is None:
                        break
                    node = nxt
                    accepted += 1
                    if is_stop(choice):
                        break
            else:
                for i, guess in enumerate(guesses):
                    p = _softmax(rows[i], temperature)
                    q = qs[i]
                    q_guess = 1.0 if q is None else float(q[guess])
                    if rng.random() * q_guess < p[guess]:
                        emitted.append((guess, rows[i]))
                        node, accepted = i + 1, accepted + 1
                        if is_stop(guess):
                            break
                        continue
                    residual = p.copy()
                    if q is None:
                        residual[guess] = 0.0
                    else:
                        residual = np.maximum(p - q, 0.0)
                    total = residual.sum()
                    r = residual / total if total > 0 else p
                    emitted.append((int(rng.choice(r.shape[0], p=r)), rows[i]))
                    break
                else:
                    # Every draft accepted: the target's own next token is free.
                    p = _softmax(rows[len(guesses)], temperature)
                    emitted.append((int(rng.choice(p.shape[0], p=p)), rows[len(guesses)]))
            # Keep the path to `node` (the pending token and the accepted
            # drafts); the last emitted token is the next round's pending one.
            kept = len(emitted) - 1
            if adaptive and guesses:
                k_now = max(1, min(k, kept + 1))
            trunk = await _keep_path(tree, node, base + len(tree.path(node)))
            for token, logits in emitted:
                if is_stop(token):
                    rec.stopped = True
                    break
                rec.add(
                    token,
                    target.model_surprisal(token, logits=logits),
                    target.model_entropy(logits=logits),
                )
                history.append(token)
    finally:
        for branch in [trunk, *(b for b in (tree.branches if tree else ()) if b is not trunk)]:
            await _prune_all(branch)
        if isinstance(drafter, _ModelDrafter):
            with anyio.CancelScope(shield=True):
                await drafter.reset()
    if isinstance(draft, Context):
        draft_calls = draft.stats.decode_calls - draft_calls
    return Speculative(
        await rec.finish(target),
        rounds,
        drafted,
        accepted,
        target.stats.decode_calls - calls,
        draft_calls,
        time.perf_counter() - started,
        verified,
    )


def _add_siblings(
    nodes: list[int],
    parents: list[int],
    qs: Sequence[_F64 | None],
    width: int,
    confidence: float,
    leases: int,
) -> None:
    """Give each uncertain draft (top probability below ``confidence``) the
    drafter's next ``width - 1`` candidates as siblings, while leases last
    (one per sibling: each is a leaf of the token tree)."""
    for i, q in enumerate(qs):
        if q is None or float(np.max(q)) >= confidence:
            continue
        for alt in _top(np.log(np.maximum(q, 1e-300)), width):
            if leases == 0:
                return
            if alt != nodes[i + 1]:
                nodes.append(alt)
                parents.append(i)  # after node i: a sibling of draft i
                leases -= 1


async def _keep_path(tree: TokenTree, node: int, position: int) -> Branch:
    """Keep the branch holding the path to ``node``, cut to ``position``
    with ``node``'s row as its logits; prune the tree's other branches."""
    keep = tree.branch_of(node)
    for branch in tree.branches:
        if branch is not keep:
            await branch.prune()
    if keep.position > position:
        await keep.truncate(position, logits=tree.rows[node])
    return keep
