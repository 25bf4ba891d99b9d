""":func:`beam_search`: width-W beam search on summed log-probabilities."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context
from lloyal.sampling import GREEDY
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    _check_positive,
    _need_leases,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
    _stopper,
)


@dataclass(frozen=True)
class BeamSearch(_Output):
    """What :func:`beam_search` returns. ``beams`` are the final
    hypotheses (finished and unfinished), best first, and ``scores`` their
    search scores: summed log-probability, including the stop token for a
    finished hypothesis (which its ``Continuation`` leaves out), divided by
    ``len ** length_penalty``. ``output`` is ``beams[0]``.
    ``peak_leases`` is the most KV leases held at once.
    :func:`lloyal.cluster.beam_search` also says how many beams moved
    between workers by their state bytes (``migrations``) and how many
    were dropped with a worker that died (``lost``)."""

    output: Continuation
    beams: tuple[Continuation, ...]
    scores: tuple[float, ...]
    decode_calls: int
    peak_leases: int
    seconds: float
    migrations: int = 0
    lost: int = 0


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
            options = []
            for beam in beams:
                # Native: the best 2w tokens and the entropy, no row copied.
                top, logp = beam.branch.top_logprobs(2 * width)
                ent = beam.branch.model_entropy()
                options.append((beam.score, beam.rec, top.tolist(), logp.tolist(), ent))
            chosen, recs = _choose_beams(options, width, is_stop, finished)
            if progress is not None:
                progress(step + 1, max_tokens)
            if _search_ends(chosen, finished, step, max_tokens, length_penalty):
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
    ranked = _ranked(finished + final, width, length_penalty)
    beams_out = tuple([await rec.finish(ctx) for _, rec in ranked])
    return BeamSearch(
        beams_out[0],
        beams_out,
        tuple(score for score, _ in ranked),
        ctx.stats.decode_calls - calls,
        peak,
        time.perf_counter() - started,
    )


_Candidate = tuple[float, int, int, float, float]
"""A possible next beam: (score, parent beam index, token, surprisal, entropy)."""

_Hypothesis = tuple[float, _Recorder]


def _choose_beams(
    options: Sequence[tuple[float, _Recorder, Sequence[int], Sequence[float], float]],
    width: int,
    is_stop: Callable[[int], bool],
    finished: list[_Hypothesis],
) -> tuple[list[_Candidate], list[_Hypothesis]]:
    """One step of beam search, wherever the beams live. ``options`` has,
    per beam, its score and record, its top next tokens with their
    log-probabilities, and the entropy they come from. Candidates are
    ranked by summed log-probability (ties: beam, then token); one that
    stops finishes its hypothesis into ``finished`` (which keeps the best
    ``width``); the best ``width`` others are chosen. Returns them and
    their records (the parent's plus the token)."""
    candidates: list[_Candidate] = []
    for bi, (score, _, tokens, logprobs, ent) in enumerate(options):
        for t, lp in zip(tokens, logprobs, strict=True):
            candidates.append((score + lp, bi, t, -lp, ent))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen: list[_Candidate] = []
    for cand in candidates:
        if len(chosen) == width:
            break
        if is_stop(cand[2]):
            rec = options[cand[1]][1].copy()
            rec.stopped = True
            finished.append((cand[0], rec))
        else:
            chosen.append(cand)
    finished.sort(key=lambda f: -f[0])
    del finished[width:]
    recs = []
    for score, bi, t, surprisal, ent in chosen:
        rec = options[bi][1].copy()
        rec.add(t, surprisal, ent)
        recs.append((score, rec))
    return chosen, recs


def _search_ends(
    chosen: list[_Candidate],
    finished: list[_Hypothesis],
    step: int,
    max_tokens: int,
    length_penalty: float,
) -> bool:
    """Whether the search stops after this step: nothing left to extend,
    the token limit, or (no length penalty) no live beam can beat the best
    finished hypothesis."""
    return (
        not chosen
        or step + 1 == max_tokens
        or (length_penalty == 0.0 and bool(finished) and finished[0][0] >= chosen[0][0])
    )


def _ranked(hypotheses: list[_Hypothesis], width: int, length_penalty: float) -> list[_Hypothesis]:
    """The best ``width`` hypotheses by ``log_prob / len ** length_penalty``."""

    def rank(score: float, rec: _Recorder) -> float:
        n = len(rec.tokens) + rec.stopped
        return score / math.pow(n, length_penalty) if length_penalty and n else score

    return sorted(((rank(*h), h[1]) for h in hypotheses), key=lambda h: -h[0])[:width]
