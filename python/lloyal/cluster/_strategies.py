"""Strategies spread over a :class:`ContextPool`.

Length: for now these are a second writing of :mod:`lloyal.strategies`
(``best_of_n``, ``beam_search``, ``mcts``) over remote branches, with
workers that may be lost; issue 28 (item 2) writes each strategy once over
a backend protocol, and this file goes. Until then the remote-equals-local
tests (tests/test_cluster.py) hold the two writings to the same results.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lloyal.branch import Produced
from lloyal.cluster._pool import ContextPool, RemoteBranch, Worker
from lloyal.errors import WorkerLostError
from lloyal.sampling import GREEDY, SamplingParams
from lloyal.strategies import MCTS, BeamSearch, BestOfN, Continuation, TreeNode
from lloyal.strategies._beam_search import _choose_beams, _ranked, _search_ends
from lloyal.strategies._common import Progress, Prompt, Score, _check_positive, _Recorder

__all__ = ["beam_search", "best_of_n", "mcts"]


async def best_of_n(
    pool: ContextPool,
    prompt: Prompt,
    n: int = 4,
    *,
    max_tokens: int = 64,
    params: SamplingParams | None = None,
    seed: int = 0,
    stop: Iterable[int] = (),
) -> BestOfN:
    """:func:`lloyal.strategies.best_of_n` with the candidates spread over
    the pool's workers, round robin: each worker decodes the prompt once
    (through its prefix cache) and forks its candidates from it. Candidate
    ``i`` is seeded ``seed + i`` as locally, so on contexts created with
    ``deterministic=True`` the result equals the local one. Each step is
    one round trip and one decode per worker for all its candidates.
    ``decode_calls`` counts the decodes of all workers. Candidates whose
    worker dies are listed in ``lost`` and the rest go on; only when every
    candidate is lost is it a :class:`WorkerLostError`."""
    _check_positive(n=n, max_tokens=max_tokens)
    params = params or SamplingParams(temperature=0.8)
    tokens, extra, before, started = await _begin(pool, prompt, stop)
    used = pool.workers[: min(n, len(pool.workers))]
    roots = await _roots(pool, tokens, params, used)
    branches: list[RemoteBranch] = [None] * n  # type: ignore[list-item]
    try:
        for w, root in enumerate(roots):
            mine = list(range(w, n, len(used)))
            children = await root.fork_many([seed + i for i in mine])
            for i, child in zip(mine, children, strict=True):
                branches[i] = child
        recs = [_Recorder() for _ in range(n)]
        lost: list[int] = []
        live = list(range(n))
        made = await asyncio.gather(*(branches[i].produce() for i in live), return_exceptions=True)
        for step in range(max_tokens):
            going = []
            for i, p in zip(live, made, strict=True):
                if isinstance(p, WorkerLostError):  # its worker died: go on without it
                    lost.append(i)
                    continue
                if isinstance(p, BaseException):
                    raise p
                if p.is_stop or p.token in extra:
                    recs[i].stopped = True
                    continue
                b = branches[i]
                recs[i].add(p.token, b.last_surprisal, b.last_entropy)
                going.append(i)
            live = going
            if not live or step + 1 == max_tokens:
                break
            # Commit this step's tokens and produce the next ones: one round
            # trip and one decode per worker.
            made = await asyncio.gather(
                *(branches[i].step(recs[i].tokens[-1]) for i in live), return_exceptions=True
            )
    finally:
        await asyncio.gather(
            *(b.prune() for b in [*branches, *roots] if b is not None), return_exceptions=True
        )
    if len(lost) == n:
        raise WorkerLostError("every worker holding a candidate died")
    texts = await asyncio.gather(*(_detokenize(pool, r.tokens) for r in recs))
    candidates = tuple(_continuation(text, r) for text, r in zip(texts, recs, strict=True))
    kept = [i for i in range(n) if i not in lost]
    best = min(kept, key=lambda i: (candidates[i].perplexity, i))
    return BestOfN(
        candidates[best],
        candidates,
        best,
        max(0, await _decodes(pool) - before),
        time.perf_counter() - started,
        tuple(sorted(lost)),
    )


async def _detokenize(pool: ContextPool, tokens: list[int]) -> str:
    """Text of ``tokens`` from any live worker."""
    text: str = await _any_worker(pool, "detokenize", tokens)
    return text


async def _any_worker(pool: ContextPool, method: str, *args: Any) -> Any:
    """``method`` on the first worker that is alive (every worker has the
    same model: tokenizer calls give the same answer anywhere)."""
    for w in pool.workers:
        try:
            return await w.call(method, *args)
        except WorkerLostError:
            continue
    raise WorkerLostError(f"no worker is left to {method}")


async def _decodes(pool: ContextPool) -> int:
    """Decodes of all workers (a replaced worker counts from its restart)."""
    stats = await asyncio.gather(*(w.call("stats") for w in pool.workers), return_exceptions=True)
    return sum(s["decode_calls"] for s in stats if isinstance(s, dict))


_Top = tuple[list[int], list[float], float, list[bool]]


@dataclass
class _Beam:
    branch: RemoteBranch
    rec: _Recorder
    score: float
    top: _Top  # its next-token candidates: tokens, logprobs, entropy, stop flags
    spares: dict[Worker, RemoteBranch] = field(default_factory=dict)
    """Other branches in the same state (the prompt on each worker)."""


async def beam_search(
    pool: ContextPool,
    prompt: Prompt,
    width: int = 4,
    *,
    max_tokens: int = 32,
    length_penalty: float = 0.0,
    stop: Iterable[int] = (),
    spread: bool = True,
    progress: Progress | None = None,
) -> BeamSearch:
    """:func:`lloyal.strategies.beam_search` with the beams spread over
    the pool's workers: at most ``ceil(width / workers)`` on each.

    Every worker decodes the prompt once (through its prefix cache). A
    beam chosen more than once forks on its own worker while that worker
    is under its share; past it, the child is made on the worker with the
    fewest beams by the parent's state bytes (counted in ``migrations``).
    Each step is one round trip and one decode per worker for all its
    beams' commits and next-token candidates, plus one for forks. The
    choices are the local function's, so on contexts created with
    ``deterministic=True`` the result equals the local one.
    ``decode_calls`` counts the decodes of all workers; ``peak_leases``
    the most branches held at once. Beams whose worker dies are dropped
    (counted in ``lost``) and the search goes on with the rest; only when
    none is left is it a :class:`WorkerLostError`.

    Spreading pays when a step's decode costs much more than moving a
    beam's KV cells (large models, wide beams, fast links). ``spread=False``
    runs the whole search on one worker (placed by prefix and load, as
    :meth:`ContextPool.place`), with no moves: the way to run many beam
    searches at once over a pool, one per worker.

    Needs ``width + 1`` free KV leases between the workers.

    >>> import asyncio, ray, lloyal
    >>> from lloyal.cluster import ContextPool, beam_search
    >>> async def main():
    ...     pool = await ContextPool.start(MODEL, workers=2, n_seq_max=4, n_threads=1)
    ...     try:
    ...         return await beam_search(pool, "The capital of France is", width=2, max_tokens=1)
    ...     finally:
    ...         await pool.aclose()
    >>> ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # doctest: +ELLIPSIS
    RayContext(...)
    >>> result = asyncio.run(main())
    >>> ray.shutdown()
    >>> result.text, len(result.beams)
    (' Paris', 2)
    """
    _check_positive(width=width, max_tokens=max_tokens)
    await _need_leases(pool, width + 1, f"beam_search(width={width})")
    tokens, extra, before, started = await _begin(pool, prompt, stop)
    used = pool.workers[: min(width, len(pool.workers))] if spread else [await pool.place(tokens)]
    share = -(-width // len(used))

    stop_ids = set(extra)  # the model's stop tokens, as the workers flag them

    def is_stop(t: int) -> bool:
        return t in stop_ids

    roots = await _roots(pool, tokens, GREEDY, used)
    held: set[RemoteBranch] = set(roots)
    peak = len(held)
    moved = lost = 0
    finished: list[tuple[float, _Recorder]] = []
    final: list[tuple[float, _Recorder]] = []
    try:
        first = await roots[0]._top(2 * width)
        beams = [_Beam(roots[0], _Recorder(), 0.0, first, {r.worker: r for r in roots[1:]})]
        for step in range(max_tokens):
            # The local function's choice, step for step.
            options = []
            for beam in beams:
                toks, logps, ent, stops = beam.top
                stop_ids.update(t for t, st in zip(toks, stops, strict=True) if st)
                options.append((beam.score, beam.rec, toks, logps, ent))
            chosen, recs = _choose_beams(options, width, is_stop, finished)
            if progress is not None:
                progress(step + 1, max_tokens)
            if _search_ends(chosen, finished, step, max_tokens, length_penalty):
                final = recs
                break
            plan = _plan(beams, [c[1] for c in chosen], used, share)
            # Free what no new beam keeps (forks and copies are made from
            # kept branches), then make the new branches.
            kept = {x for how, x in plan if how == "keep"}
            await asyncio.gather(*(b.prune() for b in held - kept), return_exceptions=True)
            held &= kept
            made = await _make(plan)
            moved += sum(1 for how, _ in plan if how == "copy")
            held.update(b for b in made if isinstance(b, RemoteBranch))  # before any raise
            pending: list[tuple[RemoteBranch, int, float, _Recorder]] = []
            for (score, _, t, *_), (_, rec), branch in zip(chosen, recs, made, strict=True):
                if isinstance(branch, WorkerLostError):
                    lost += 1
                elif isinstance(branch, BaseException):
                    raise branch
                else:
                    pending.append((branch, t, score, rec))
            peak = max(peak, len(held))
            new_beams: list[_Beam] = []
            tops = await asyncio.gather(
                *(b._advance(t, top=2 * width) for b, t, *_ in pending), return_exceptions=True
            )
            for (branch, _, score, rec), outcome in zip(pending, tops, strict=True):
                if isinstance(outcome, WorkerLostError):
                    lost += 1
                    held.discard(branch)
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                new_beams.append(_Beam(branch, rec, score, outcome[1]))
            if not new_beams:
                if finished:
                    break
                raise WorkerLostError("every worker holding a beam died")
            beams = new_beams
    finally:
        await asyncio.gather(*(b.prune() for b in held), return_exceptions=True)
    ranked = _ranked(finished + final, width, length_penalty)
    texts = await asyncio.gather(*(_detokenize(pool, rec.tokens) for _, rec in ranked))
    beams_out = tuple(_continuation(t, rec) for t, (_, rec) in zip(texts, ranked, strict=True))
    return BeamSearch(
        beams_out[0],
        beams_out,
        tuple(score for score, _ in ranked),
        max(0, await _decodes(pool) - before),
        peak,
        time.perf_counter() - started,
        moved,
        lost,
    )


def _plan(
    beams: list[_Beam], parents: list[int], used: list[Worker], share: int
) -> list[tuple[str, Any]]:
    """Where each new beam (a child of ``beams[parents[i]]``) goes:
    ``("keep", branch)`` continues the parent's own branch (its first
    child) or a spare copy of it; ``("fork", i)`` forks new beam ``i``'s
    branch, on the same worker, before it moves; ``("copy", (branch,
    worker))`` copies the parent's branch there by its state bytes. A
    worker takes children up to its ``share``; the rest go to the worker
    with the fewest."""
    count: dict[Worker, int] = dict.fromkeys(used, 0)
    plan: list[tuple[str, Any]] = [("", None)] * len(parents)
    there: dict[tuple[int, Worker], int] = {}  # a new beam holding the parent's state
    for ci, bi in enumerate(parents):
        if parents.index(bi) == ci:
            branch = beams[bi].branch
            plan[ci] = ("keep", branch)
            count[branch.worker] = count.get(branch.worker, 0) + 1
            there[(bi, branch.worker)] = ci
    for ci, bi in enumerate(parents):
        if plan[ci][0]:
            continue
        beam = beams[bi]
        home = beam.branch.worker
        if count.get(home, 0) < share:
            target = home
        else:
            target = min(used, key=lambda w: (count[w], w.index))
        count[target] = count.get(target, 0) + 1
        if target in beam.spares:
            plan[ci] = ("keep", beam.spares.pop(target))
            there[(bi, target)] = ci
        elif (bi, target) in there:
            plan[ci] = ("fork", there[(bi, target)])
        else:
            plan[ci] = ("copy", (beam.branch, target))
            there[(bi, target)] = ci
    return plan


async def _make(plan: list[tuple[str, Any]]) -> list[RemoteBranch | BaseException]:
    """The branches of a :func:`_plan`: copies (one export per parent),
    then forks (one round trip per branch forked). A failure stands in
    the place of each branch it cost."""
    out: list[RemoteBranch | BaseException | None] = [
        x if how == "keep" else None for how, x in plan
    ]
    copies: dict[RemoteBranch, list[int]] = {}
    forks: dict[int, list[int]] = {}
    for ci, (how, x) in enumerate(plan):
        if how == "copy":
            copies.setdefault(x[0], []).append(ci)
        elif how == "fork":
            forks.setdefault(x, []).append(ci)

    async def copy(source: RemoteBranch, cis: list[int]) -> None:
        made: list[Any]
        try:
            targets = [plan[ci][1][1] for ci in cis]
            made = await source._copies(targets, [None] * len(cis), elsewhere=True)
        except Exception as e:
            made = [e] * len(cis)
        for ci, b in zip(cis, made, strict=True):
            out[ci] = b

    async def fork(source: int, cis: list[int]) -> None:
        parent = out[source]
        try:
            if isinstance(parent, BaseException):
                raise parent
            assert parent is not None
            made: list[Any] = await parent.fork_many([None] * len(cis))
        except Exception as e:
            made = [e] * len(cis)
        for ci, b in zip(cis, made, strict=True):
            out[ci] = b

    await asyncio.gather(*(copy(s, cis) for s, cis in copies.items()))
    await asyncio.gather(*(fork(s, cis) for s, cis in forks.items()))
    assert all(b is not None for b in out)
    return out  # type: ignore[return-value]


def _continuation(text: str, rec: _Recorder) -> Continuation:
    return Continuation(
        text, tuple(rec.tokens), tuple(rec.surprisals), tuple(rec.entropies), rec.stopped
    )


async def _roots(
    pool: ContextPool, tokens: list[int], params: SamplingParams, workers: list[Worker]
) -> list[RemoteBranch]:
    """The prompt on each of ``workers`` (through their prefix caches):
    all of them, or none (what was made is pruned again)."""
    made = await asyncio.gather(
        *(pool.branch(tokens, params=params, worker=w) for w in workers), return_exceptions=True
    )
    roots = [b for b in made if isinstance(b, RemoteBranch)]
    for outcome in made:
        if isinstance(outcome, BaseException):
            await asyncio.gather(*(b.prune() for b in roots), return_exceptions=True)
            raise outcome
    return roots


async def _need_leases(pool: ContextPool, n: int, what: str) -> None:
    """ValueError unless the workers have ``n`` free leases between them
    (a branch spills over to another worker when its own runs out)."""
    loads = await pool._loads()
    free = sum(load["free"] for _, load in loads)
    if free < n:
        raise ValueError(
            f"{what} needs {n} free KV leases but the pool's {len(loads)} live workers have "
            f"{free}: start the pool with more workers or a larger n_seq_max"
        )


async def _begin(
    pool: ContextPool, prompt: Prompt, stop: Iterable[int]
) -> tuple[list[int], frozenset[int], int, float]:
    """What every search starts from: the prompt's tokens, the extra stop
    tokens, the workers' decode count and the clock."""
    tokens = await _tokens(pool, prompt)
    return tokens, frozenset(int(t) for t in stop), await _decodes(pool), time.perf_counter()


async def _tokens(pool: ContextPool, prompt: Prompt) -> list[int]:
    """The prompt's tokens (text tokenized by a worker)."""
    tokens: list[int] = (
        await _any_worker(pool, "tokenize", prompt)
        if isinstance(prompt, str)
        else [int(t) for t in prompt]
    )
    if not tokens:
        raise ValueError("the prompt is empty")
    return tokens


@dataclass(eq=False)
class _Node:
    """A token of the search tree; ``branch`` is held by leaves only (the
    root holds one per worker in ``spares``)."""

    token: int
    log_prob: float
    surprisal: float
    entropy: float
    parent: _Node | None = None
    children: list[_Node] = field(default_factory=list)
    branch: RemoteBranch | None = None
    top: _Top | None = None
    terminal: bool = False
    visits: int = 0
    value_sum: float = 0.0
    pending: int = 0  # iterations running below this node (virtual visits)
    busy: bool = False  # being expanded
    dead: bool = False  # its worker died
    spares: dict[Worker, RemoteBranch] = field(default_factory=dict)

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


async def mcts(
    pool: ContextPool,
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
    """:func:`lloyal.strategies.mcts` over the pool's workers.

    Every worker decodes the prompt once (through its prefix cache); the
    first level of the tree is dealt round robin over the workers, and
    each subtree stays on its worker (its forks share KV there). Rollouts
    are forks of the expanded node, sampled in lockstep: one round trip
    and one decode per step for each worker's rollouts.

    ``parallel`` iterations run at once (tree parallelism with virtual
    visits): a running iteration counts as a visit for the others'
    choices, and a node being expanded is not chosen again until it is
    done, so concurrent iterations tend to go down different subtrees, on
    different workers. With ``parallel=1`` the search is the local
    function's, step for step: on contexts created with
    ``deterministic=True`` it finds the same tree and result (the tree's
    log-probabilities come from the workers' native top-k, equal to the
    local ones to rounding). Larger values depend on timing.

    Needs ``iterations * (width - 1) + width + 1 + (parallel - 1) * width``
    free KV leases between the workers (a fork its worker has no lease for
    is made on another); fewer is a ``ValueError`` before anything runs.

    A node whose worker dies is dropped with its subtree (``lost`` counts
    them) and is not chosen again; the search goes on with the rest of the
    tree, and only when nothing was scored is it a
    :class:`WorkerLostError`.

    >>> import asyncio, ray
    >>> from lloyal.cluster import ContextPool, mcts
    >>> async def main():
    ...     pool = await ContextPool.start(MODEL, workers=2, n_seq_max=8, n_threads=1)
    ...     try:
    ...         return await mcts(pool, "My favourite colour is", lambda text: -len(text),
    ...                           iterations=4, width=2, rollout_tokens=3, parallel=2)
    ...     finally:
    ...         await pool.aclose()
    >>> ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # doctest: +ELLIPSIS
    RayContext(...)
    >>> result = asyncio.run(main())
    >>> ray.shutdown()
    >>> result.iterations, result.score == -len(result.text), result.lost
    (4, True, 0)
    """
    _check_positive(
        iterations=iterations, width=width, rollout_tokens=rollout_tokens, parallel=parallel
    )
    params = params or SamplingParams(temperature=0.8)
    need = iterations * (width - 1) + width + 1 + (parallel - 1) * width
    await _need_leases(pool, need, f"mcts(iterations={iterations}, parallel={parallel})")
    tokens, extra, before, started = await _begin(pool, prompt, stop)
    used = pool.workers[: min(width, len(pool.workers))]
    roots = await _roots(pool, tokens, params, used)
    root = _Node(-1, 0.0, 0.0, 0.0, branch=roots[0], spares={r.worker: r for r in roots[1:]})
    best: tuple[float, Continuation] | None = None
    state = {"started": 0, "done": 0, "seeds": 0, "rollouts": 0, "lost": 0}
    changed = asyncio.Event()  # an iteration finished: selections may change

    async def evaluate(text: str) -> float:
        value = score(text)
        if inspect.isawaitable(value):
            value = await value
        return float(value)

    async def record(node: _Node, rec: _Recorder) -> None:
        nonlocal best
        out = _continuation(await _detokenize(pool, rec.tokens), rec)
        value = await evaluate(out.text)
        walk: _Node | None = node
        while walk is not None:
            walk.visits += 1
            walk.value_sum += value
            walk = walk.parent
        if best is None or value > best[0]:
            best = (value, out)

    def select() -> _Node | None:
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
        child gets a branch, committed onto its token (with its top-k). A
        child whose worker dies is marked dead."""
        assert leaf.branch is not None
        if leaf.top is None:
            leaf.top = await leaf.branch._top(width)
        toks, logps, ent, stops = leaf.top
        kids = [
            _Node(t, leaf.log_prob + lp, -lp, ent, parent=leaf, terminal=st or t in extra)
            for t, lp, st in zip(toks[:width], logps[:width], stops[:width], strict=True)
        ]
        live = [k for k in kids if not k.terminal]
        # The root deals its children round robin over its copies, one per
        # worker; any other node keeps them on its own worker. The first
        # child on a worker takes the copy over, the others fork it.
        sources = [leaf.branch, *leaf.spares.values()]
        groups: dict[RemoteBranch, list[_Node]] = {}
        for j, kid in enumerate(live):
            groups.setdefault(sources[j % len(sources)], []).append(kid)
        grouped = list(groups.items())
        forked = await asyncio.gather(
            *(src.fork_many([None] * (len(g) - 1)) for src, g in grouped if len(g) > 1),
            return_exceptions=True,
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
            leaf.children = kids  # so that the final prune finds their branches
            raise failure
        leaf.branch, leaf.spares, leaf.children = None, {}, kids  # the kids hold them now
        unused = [src for src in sources if not any(k.branch is src for k in live)]
        await asyncio.gather(*(src.prune() for src in unused), return_exceptions=True)
        moving = [k for k in live if k.branch is not None]
        tops = await asyncio.gather(
            *(k.branch._advance(k.token, top=width) for k in moving),  # type: ignore[union-attr]
            return_exceptions=True,
        )
        for kid, outcome in zip(moving, tops, strict=True):
            if isinstance(outcome, WorkerLostError):
                kid.dead = True
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                kid.top = outcome[1]

    async def rollout(kids: list[_Node], base: int) -> list[_Recorder]:
        """Sample a continuation of each kid, in lockstep; kid ``j``'s fork
        is seeded ``seed + base + j`` (as locally)."""
        recs = [recorder(k) for k in kids]
        forks: list[RemoteBranch | None] = [None] * len(kids)

        def lost(j: int, outcome: object) -> bool:
            if isinstance(outcome, WorkerLostError):
                kids[j].dead = True
                return True
            if isinstance(outcome, BaseException):
                raise outcome
            return False

        try:
            todo = [j for j, k in enumerate(kids) if k.branch is not None and not k.dead]
            made = await asyncio.gather(
                *(kids[j].branch.fork(seed=seed + base + j) for j in todo),  # type: ignore[union-attr]
                return_exceptions=True,
            )
            for j, fork in zip(todo, made, strict=True):
                if isinstance(fork, RemoteBranch):  # held before any error is raised
                    forks[j] = fork
            for j, fork in zip(todo, made, strict=True):
                lost(j, fork)
            live = [j for j, f in enumerate(forks) if f is not None]
            produced = await asyncio.gather(
                *(forks[j].produce() for j in live),  # type: ignore[union-attr]
                return_exceptions=True,
            )
            for step in range(rollout_tokens):
                going = []
                for j, p in zip(live, produced, strict=True):
                    if lost(j, p):
                        continue
                    assert isinstance(p, Produced)
                    if p.is_stop or p.token in extra:
                        recs[j].stopped = True
                        continue
                    f = forks[j]
                    assert f is not None
                    recs[j].add(p.token, f.last_surprisal, f.last_entropy)
                    going.append(j)
                live = going
                if not live or step + 1 == rollout_tokens:
                    break
                produced = await asyncio.gather(
                    *(forks[j].step(recs[j].tokens[-1]) for j in live),  # type: ignore[union-attr]
                    return_exceptions=True,
                )
        finally:
            await asyncio.gather(
                *(f.prune() for f in forks if f is not None), return_exceptions=True
            )
        return recs

    async def iteration(leaf: _Node) -> None:
        if leaf.terminal or (leaf.branch is None and leaf is not root):
            await record(leaf, recorder(leaf))
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
            await record(kid, rec)
            state["rollouts"] += 1

    async def runner() -> None:
        while state["started"] < iterations:
            leaf = select()
            if leaf is None:
                if state["started"] - state["done"] == 0:
                    return  # nothing open and nothing running: the tree is spent
                changed.clear()
                await changed.wait()
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
                changed.set()
                if progress is not None:
                    progress(state["done"], iterations)

    runners = [asyncio.ensure_future(runner()) for _ in range(parallel)]
    try:
        await asyncio.gather(*runners)
    finally:
        # One runner's error (or a cancellation) stops the others before
        # the tree is swept, so that nothing they make afterwards leaks.
        for task in runners:
            task.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        held = [b for n in _walk(root) for b in (n.branch, *n.spares.values()) if b is not None]
        await asyncio.gather(*(b.prune() for b in held), return_exceptions=True)
    if best is None:
        raise WorkerLostError("every iteration was lost with its worker")
    ids = sorted({n.token for n in _walk(root) if n.token >= 0})
    texts = dict(zip(ids, await _token_texts(pool, ids), strict=True))
    return MCTS(
        best[1],
        best[0],
        tuple(_freeze(c, texts) for c in root.children),
        state["done"],
        state["rollouts"],
        max(0, await _decodes(pool) - before),
        time.perf_counter() - started,
        state["lost"],
    )


def _walk(root: _Node) -> list[_Node]:
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children)
    return out


def _freeze(node: _Node, texts: dict[int, str]) -> TreeNode:
    return TreeNode(
        node.token,
        texts[node.token],
        node.log_prob,
        node.surprisal,
        node.entropy,
        tuple(_freeze(c, texts) for c in node.children),
        node.visits,
        node.value_sum / node.visits if node.visits else 0.0,
    )


async def _token_texts(pool: ContextPool, tokens: list[int]) -> list[str]:
    """Texts of ``tokens`` from any live worker."""
    texts: list[str] = await _any_worker(pool, "token_texts", tokens)
    return texts
