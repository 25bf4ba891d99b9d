"""Ready-made search strategies, built only on the public API.

Each function takes a :class:`~lloyal.Context` and a prompt (text, or token
ids), runs its search with :class:`~lloyal.Branch` and
:class:`~lloyal.BranchStore`, prunes every branch it made before returning
(also on error or cancellation), and returns a small frozen dataclass: the
chosen :class:`Continuation` (text, tokens, per-token surprisal and entropy)
plus the numbers a researcher asks for -- how many ``llama_decode`` calls
it took (from ``ctx.stats``), acceptance rates, scores, wall time.

* :func:`generate` -- one branch, produce/commit until a stop token; the
  baseline the others are measured against.
* :func:`best_of_n` -- N forks of one prefilled prompt, generated in
  lockstep (one decode per step for all N), the lowest perplexity wins.
* :func:`beam_search` -- width-W beam search on summed log-probabilities.
* :func:`speculative_decode` -- draft tokens cheaply (a smaller model with
  the same vocabulary, or :class:`PromptLookup`), verify them all in one
  target decode, keep the accepted prefix plus one token from the target.
* :func:`sample_tree` and :func:`mcts` -- token trees expanded one batched
  decode per level, and a small Monte Carlo tree search over them.

Surprisal and entropy are in nats, measured on the model's raw
distribution at the step where each token was chosen. ``decode_calls``
counts every decode on the context while the function ran (other work on
the same context at the same time is counted too).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import anyio
import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore, TokenTree
from lloyal.context import Context
from lloyal.errors import BranchBusyError
from lloyal.sampling import GREEDY, SamplingParams

Prompt = str | Sequence[int]
"""Text (tokenized with the model's BOS rule) or token ids."""

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` after each step of a long search."""

Score = Callable[[str], float | Awaitable[float]]
"""Scores a generated text (higher is better); may be a coroutine function."""

_F64 = npt.NDArray[np.float64]


# -- results -------------------------------------------------------------------


@dataclass(frozen=True)
class Continuation:
    """Generated tokens and what the model thought of each.

    ``surprisals[i]`` is ``-log p(tokens[i])`` and ``entropies[i]`` the
    entropy of the distribution it was chosen from (nats, the model's raw
    distribution). ``stopped`` says whether generation ended on a stop
    token (which is not included) rather than on the token limit.
    """

    text: str
    tokens: tuple[int, ...]
    surprisals: tuple[float, ...]
    entropies: tuple[float, ...]
    stopped: bool

    @property
    def log_prob(self) -> float:
        """Sum of the tokens' log-probabilities (nats)."""
        return -math.fsum(self.surprisals)

    @property
    def perplexity(self) -> float:
        """``exp`` of the mean surprisal; ``inf`` for no tokens."""
        if not self.surprisals:
            return math.inf
        return math.exp(math.fsum(self.surprisals) / len(self.surprisals))


class _Output:
    """``text``, ``tokens`` and ``perplexity`` of a result's ``output``."""

    output: Continuation

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.output.tokens

    @property
    def perplexity(self) -> float:
        return self.output.perplexity


@dataclass(frozen=True)
class Generated(_Output):
    """What :func:`generate` returns."""

    output: Continuation
    decode_calls: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.output.tokens) / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class BestOfN(_Output):
    """What :func:`best_of_n` returns: every candidate, and the winner
    (``candidates[best_index]``, the lowest perplexity)."""

    output: Continuation
    candidates: tuple[Continuation, ...]
    best_index: int
    decode_calls: int
    seconds: float


@dataclass(frozen=True)
class BeamSearch(_Output):
    """What :func:`beam_search` returns. ``beams`` are the final
    hypotheses (finished and unfinished), best first, and ``scores`` their
    search scores: summed log-probability, including the stop token for a
    finished hypothesis (which its ``Continuation`` leaves out), divided by
    ``len ** length_penalty``. ``output`` is ``beams[0]``.
    ``peak_leases`` is the most KV leases held at once."""

    output: Continuation
    beams: tuple[Continuation, ...]
    scores: tuple[float, ...]
    decode_calls: int
    peak_leases: int
    seconds: float


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


@dataclass(frozen=True)
class MCTS(_Output):
    """What :func:`mcts` returns: the best-scoring rollout as ``output``
    (with its ``score``), the searched tree (``roots``: the first tokens
    considered, with visit counts and mean values) and the cost."""

    output: Continuation
    score: float
    roots: tuple[TreeNode, ...]
    iterations: int
    rollouts: int
    decode_calls: int
    seconds: float


# -- shared helpers ------------------------------------------------------------


async def _prompt_tokens(ctx: Context, prompt: Prompt) -> list[int]:
    tokens = await ctx.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not tokens:
        raise ValueError("the prompt is empty")
    return tokens


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _need_leases(store: BranchStore, ctx: Context, n: int, what: str) -> None:
    if store.available < n:
        raise ValueError(
            f"{what} needs {n} free KV leases but {store.available} of the context's "
            f"n_seq_max={ctx.n_seq_max} are free: create the context with n_seq_max >= {n}"
        )


def _log_softmax(logits: npt.ArrayLike) -> _F64:
    x = np.asarray(logits, dtype=np.float64)
    m = float(np.max(x))
    out: _F64 = x - (m + math.log(float(np.sum(np.exp(x - m)))))
    return out


def _entropy(logp: _F64) -> float:
    p = np.exp(logp)
    finite = p > 0
    return float(-np.sum(p[finite] * logp[finite]))


def _top(logp: _F64, k: int) -> list[int]:
    """The ``k`` most likely tokens, best first (ties: lower id first)."""
    k = min(k, logp.shape[0])
    idx = np.argpartition(-logp, k - 1)[:k]
    return sorted((int(i) for i in idx), key=lambda t: (-logp[t], t))


class _Recorder:
    """Accumulates one continuation's tokens and metrics."""

    __slots__ = ("entropies", "stopped", "surprisals", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.surprisals: list[float] = []
        self.entropies: list[float] = []
        self.stopped = False

    def add(self, token: int, surprisal: float, entropy: float) -> None:
        self.tokens.append(token)
        self.surprisals.append(surprisal)
        self.entropies.append(entropy)

    def copy(self) -> _Recorder:
        r = _Recorder()
        r.tokens, r.surprisals, r.entropies = (
            list(self.tokens),
            list(self.surprisals),
            list(self.entropies),
        )
        r.stopped = self.stopped
        return r

    async def finish(self, ctx: Context) -> Continuation:
        return Continuation(
            await ctx.detokenize(self.tokens),
            tuple(self.tokens),
            tuple(self.surprisals),
            tuple(self.entropies),
            self.stopped,
        )


async def _prune_all(branch: Branch) -> None:
    """Prune ``branch`` and its subtree, also while the caller is being
    cancelled (shielded, so the leases come back under trio too)."""
    with anyio.CancelScope(shield=True):
        deadline = time.monotonic() + 60.0
        while not branch.disposed:
            try:
                await branch.prune_subtree()
            except BranchBusyError:
                # A cancelled prefill or commit is still running on the
                # worker; it ends soon, and the prune must come after it.
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.001)


def _stopper(ctx: Context, stop: Iterable[int]) -> Callable[[int], bool]:
    extra = frozenset(int(t) for t in stop)
    return lambda t: t in extra or ctx.is_stop_token(t)


# -- generate ------------------------------------------------------------------


async def generate(
    ctx: Context,
    prompt: Prompt,
    *,
    max_tokens: int = 64,
    params: SamplingParams = GREEDY,
    stop: Iterable[int] = (),
) -> Generated:
    """Generate on one branch until a stop token or ``max_tokens``.

    The plain decoding loop (one ``llama_decode`` per token), with the
    per-token numbers the other strategies report: the baseline to compare
    them with. ``stop`` adds stop tokens to the model's own (e.g. a chat
    template's ``stop_tokens``). Needs one free KV lease.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import generate
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         return await generate(ctx, "The capital of France is", max_tokens=1)
    >>> result = asyncio.run(main())
    >>> result.text, len(result.output.surprisals), result.decode_calls
    (' Paris', 1, 1)
    """
    _check_positive(max_tokens=max_tokens)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    rec = _Recorder()
    branch = Branch.create(ctx, params=params)
    try:
        await branch.prefill(tokens)
        while len(rec.tokens) < max_tokens:
            p = await branch.produce()
            if p.is_stop or is_stop(p.token):
                rec.stopped = True
                break
            rec.add(p.token, branch.model_surprisal(p.token), branch.model_entropy())
            if len(rec.tokens) < max_tokens:
                await branch.commit(p.token)
    finally:
        await _prune_all(branch)
    out = await rec.finish(ctx)
    return Generated(out, ctx.stats.decode_calls - calls, time.perf_counter() - started)


# -- best of N -----------------------------------------------------------------


async def best_of_n(
    ctx: Context,
    prompt: Prompt,
    n: int = 4,
    *,
    max_tokens: int = 64,
    params: SamplingParams | None = None,
    seed: int = 0,
    stop: Iterable[int] = (),
    progress: Progress | None = None,
) -> BestOfN:
    """Sample ``n`` continuations in lockstep and keep the least perplexed.

    The prompt is prefilled once into a root branch; ``n`` forks share its
    KV cells, get their own random streams (seeds ``seed .. seed+n-1``) and
    advance together, one ``llama_decode`` per step for all of them
    (:meth:`BranchStore.commit`). The winner has the lowest perplexity
    under the model's raw distribution; candidates that produced no token
    have ``inf``. Needs ``n + 1`` free KV leases (``n_seq_max``).

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import best_of_n
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         return await best_of_n(ctx, "Once upon a time", n=3, max_tokens=4)
    >>> result = asyncio.run(main())
    >>> len(result.candidates), result.decode_calls    # prefill + 3 lockstep steps
    (3, 4)
    >>> result.perplexity == min(c.perplexity for c in result.candidates)
    True
    """
    _check_positive(n=n, max_tokens=max_tokens)
    params = params or SamplingParams(temperature=0.8)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    store = BranchStore(ctx)
    _need_leases(store, ctx, n + 1, f"best_of_n(n={n})")
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    recs = [_Recorder() for _ in range(n)]
    root = Branch.create(ctx, params=params)
    try:
        await root.prefill(tokens)
        branches = [await root.fork() for _ in range(n)]
        for i, b in enumerate(branches):
            b.reseed_sampler(seed + i)
        live = list(range(n))
        for step in range(max_tokens):
            items: list[tuple[Branch, int]] = []
            for i in live:
                b = branches[i]
                p = await b.produce()
                if p.is_stop or is_stop(p.token):
                    recs[i].stopped = True
                    continue
                recs[i].add(p.token, b.model_surprisal(p.token), b.model_entropy())
                items.append((b, p.token))
            live = [i for i in live if not recs[i].stopped]
            # The last step's tokens are recorded but need no decode.
            if items and step + 1 < max_tokens:
                await store.commit(items)
            if progress is not None:
                progress(step + 1, max_tokens)
            if not live:
                break
    finally:
        await _prune_all(root)
    candidates = tuple([await r.finish(ctx) for r in recs])
    best = min(range(n), key=lambda i: (candidates[i].perplexity, i))
    return BestOfN(
        candidates[best],
        candidates,
        best,
        ctx.stats.decode_calls - calls,
        time.perf_counter() - started,
    )


# -- beam search ---------------------------------------------------------------


@dataclass
class _Beam:
    branch: Branch
    rec: _Recorder
    score: float = 0.0


async def beam_search(
    ctx: Context,
    prompt: Prompt,
    width: int = 4,
    *,
    max_tokens: int = 32,
    length_penalty: float = 0.0,
    stop: Iterable[int] = (),
    progress: Progress | None = None,
) -> BeamSearch:
    """Beam search: keep the ``width`` most likely continuations.

    Each step scores every live beam's top ``2 * width`` next tokens by
    summed log-probability (from the beams' logits), keeps the best
    ``width`` that do not stop, and commits them all in one
    ``llama_decode``. A beam chosen more than once is forked; a beam not
    chosen is pruned. A hypothesis that picks a stop token is finished.
    The result ranks hypotheses by ``log_prob / len ** length_penalty``
    (``length_penalty=0``: plain log-probability, and the search stops as
    soon as no live beam can beat the best finished one). Width 1 is
    greedy decoding.

    Needs ``width`` KV leases, plus one for each pruned-but-not-freeable
    ancestor: a branch with live forks cannot give its lease back, so a
    long search whose beams keep splitting off one lineage can hold more
    (``peak_leases`` says how many it held). Give it headroom
    (``n_seq_max`` of ``2 * width`` or more); running out raises
    :class:`NoLeaseError`.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import beam_search
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=8) as ctx:
    ...         return await beam_search(ctx, "The capital of France is", width=2, max_tokens=1)
    >>> result = asyncio.run(main())
    >>> result.text, len(result.beams)
    (' Paris', 2)
    """
    _check_positive(width=width, max_tokens=max_tokens)
    tokens = await _prompt_tokens(ctx, prompt)
    is_stop = _stopper(ctx, stop)
    store = BranchStore(ctx)
    _need_leases(store, ctx, width, f"beam_search(width={width})")
    calls, started = ctx.stats.decode_calls, time.perf_counter()

    def rank(score: float, rec: _Recorder) -> float:
        n = len(rec.tokens) + rec.stopped
        return score / math.pow(n, length_penalty) if length_penalty and n else score

    finished: list[tuple[float, _Recorder]] = []
    root = Branch.create(ctx, params=GREEDY)
    held = {root}  # branches whose lease we hold: live beams and dead ancestors
    alive: set[Branch] = {root}  # branches that carry a live beam
    peak = 1

    async def release(b: Branch) -> None:
        # Prune ``b`` and then every dead ancestor it was the last live child of.
        node: Branch | None = b
        while node is not None and node in held and node not in alive and node.is_leaf:
            parent = node.parent
            await node.prune()
            held.discard(node)
            node = parent

    final: list[tuple[float, _Recorder]] = []
    try:
        await root.prefill(tokens)
        beams = [_Beam(root, _Recorder())]
        for step in range(max_tokens):
            candidates: list[tuple[float, int, int, float, float]] = []
            for bi, beam in enumerate(beams):
                logp = _log_softmax(beam.branch.logits)
                ent = _entropy(logp)
                for t in _top(logp, 2 * width):
                    candidates.append((beam.score + float(logp[t]), bi, t, -float(logp[t]), ent))
            candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
            chosen: list[tuple[float, int, int, float, float]] = []
            for cand in candidates:
                if len(chosen) == width:
                    break
                if is_stop(cand[2]):
                    rec = beams[cand[1]].rec.copy()
                    rec.stopped = True
                    finished.append((cand[0], rec))
                else:
                    chosen.append(cand)
            finished.sort(key=lambda f: -f[0])
            del finished[width:]
            recs = []
            for score, bi, t, surprisal, ent in chosen:
                rec = beams[bi].rec.copy()
                rec.add(t, surprisal, ent)
                recs.append((score, rec))
            if progress is not None:
                progress(step + 1, max_tokens)
            if (
                not chosen
                or step + 1 == max_tokens
                or (length_penalty == 0.0 and finished and finished[0][0] >= chosen[0][0])
            ):
                final = recs
                break
            # Free the beams nobody chose first, then fork the ones chosen
            # more than once (the first use continues the beam's own branch).
            used = {bi for _, bi, *_ in chosen}
            for bi, beam in enumerate(beams):
                if bi not in used:
                    alive.discard(beam.branch)
                    await release(beam.branch)
            new_beams: list[_Beam] = []
            continued: set[int] = set()
            for (score, bi, *_), (_, rec) in zip(chosen, recs, strict=True):
                branch = beams[bi].branch
                if bi in continued:
                    branch = await branch.fork()
                    held.add(branch)
                    alive.add(branch)
                continued.add(bi)
                new_beams.append(_Beam(branch, rec, score))
            peak = max(peak, len(held))
            await store.commit([(b.branch, b.rec.tokens[-1]) for b in new_beams])
            beams = new_beams
    finally:
        await _prune_all(root)
    ranked = sorted(((rank(*h), h[1]) for h in finished + final), key=lambda h: -h[0])[:width]
    beams_out = tuple([await rec.finish(ctx) for _, rec in ranked])
    return BeamSearch(
        beams_out[0],
        beams_out,
        tuple(score for score, _ in ranked),
        ctx.stats.decode_calls - calls,
        peak,
        time.perf_counter() - started,
    )


# -- speculative decoding ------------------------------------------------------


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
        common = 0
        for a, b in zip(self.kv, history, strict=False):
            if a != b:
                break
            common += 1
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


def _softmax(logits: npt.ArrayLike, temperature: float) -> _F64:
    x = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(x - np.max(x))
    out: _F64 = e / e.sum()
    return out


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


# -- token trees and MCTS ------------------------------------------------------


@dataclass(eq=False)
class _Node:
    token: int
    log_prob: float
    surprisal: float
    entropy: float
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    branch: Branch | None = None
    terminal: bool = False
    visits: int = 0
    value_sum: float = 0.0

    def path(self) -> list[_Node]:
        out: list[_Node] = []
        node: _Node | None = self
        while node is not None and node.token >= 0:
            out.append(node)
            node = node.parent
        return out[::-1]

    def freeze(self, ctx: Context) -> TreeNode:
        return TreeNode(
            self.token,
            ctx.token_to_text(self.token),
            self.log_prob,
            self.surprisal,
            self.entropy,
            tuple(c.freeze(ctx) for c in self.children),
            self.visits,
            self.value_sum / self.visits if self.visits else 0.0,
        )


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
        await first.branch.prune()  # type: ignore[union-attr]
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
        tuple(c.freeze(ctx) for c in root.children),
        ctx.stats.decode_calls - calls,
        time.perf_counter() - started,
    )


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


__all__ = [
    "MCTS",
    "BeamSearch",
    "BestOfN",
    "Continuation",
    "Generated",
    "PromptLookup",
    "SampledTree",
    "Speculative",
    "TreeNode",
    "beam_search",
    "best_of_n",
    "generate",
    "mcts",
    "sample_tree",
    "speculative_decode",
]
