""":func:`beam_search`: width-W beam search on summed log-probabilities."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lloyal._tasks import gather
from lloyal.context import Context
from lloyal.errors import WorkerLostError
from lloyal.sampling import GREEDY
from lloyal.strategies._common import (
    Continuation,
    Progress,
    Prompt,
    _check_positive,
    _Output,
    _Recorder,
)
from lloyal.strategies._lanes import (
    Backend,
    Lane,
    Pool,
    Top,
    backend_of,
    begin,
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
    branch: Lane
    rec: _Recorder
    score: float
    top: Top  # its next-token candidates


async def beam_search(
    ctx: Context | Pool,
    prompt: Prompt,
    width: int = 4,
    *,
    max_tokens: int = 32,
    length_penalty: float = 0.0,
    stop: Iterable[int] = (),
    spread: bool = True,
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

    On a :class:`lloyal.cluster.ContextPool` the beams are spread over the
    workers, at most ``ceil(width / workers)`` on each; every worker decodes
    the prompt once (through its prefix cache). A beam chosen more than once
    forks on its own worker while that worker is under its share; past it,
    the child is made on the worker with the fewest beams from the parent's
    state bytes (counted in ``migrations``). Each step is one round trip
    and one decode per worker for all its beams, plus one for forks; the
    choices are the ones made here, so on contexts created with
    ``deterministic=True`` the result is this one. Beams whose worker dies
    are dropped (``lost``) and the search goes on with the rest.
    ``spread=False`` runs the whole search on one worker (placed by prefix
    and load, as :meth:`~lloyal.cluster.ContextPool.place`), with no moves:
    the way to run many beam searches at once over a pool. Spreading pays
    when a step's decode costs much more than moving a beam's KV cells.
    On a context, ``spread`` changes nothing.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import beam_search
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=8) as ctx:
    ...         return await beam_search(ctx, "The capital of France is", width=2, max_tokens=1)
    >>> result = asyncio.run(main())
    >>> result.text, len(result.beams)
    (' Paris', 2)
    """
    return await _beam_search(
        backend_of(ctx), prompt, width, max_tokens, length_penalty, stop, spread, progress
    )


async def _beam_search(
    backend: Backend,
    prompt: Prompt,
    width: int,
    max_tokens: int,
    length_penalty: float,
    stop: Iterable[int],
    spread: bool,
    progress: Progress | None,
) -> BeamSearch:
    """:func:`beam_search` on any backend: with ``spread``, the beams go
    over its workers, at most ``ceil(width / workers)`` on each (a child
    past its parent's worker's share is copied to the worker with the
    fewest, counted in ``migrations``); beams whose worker dies are dropped
    (``lost``)."""
    _check_positive(width=width, max_tokens=max_tokens)
    tokens, extra, before, started = await begin(backend, prompt, stop)
    workers = backend.workers
    used = list(workers[: min(width, len(workers))]) if spread else [await backend.place(tokens)]
    # The beams, and the prompt's copy on each other worker used.
    await backend.need_leases(width + len(used) - 1, f"beam_search(width={width})")
    share = -(-width // len(used))

    stop_ids = set(extra)  # and the model's stop tokens, as the lanes flag them

    def is_stop(t: int) -> bool:
        return t in stop_ids

    held: set[Lane] = set()
    peak = moved = lost = 0
    finished: list[_Hypothesis] = []
    final: list[_Hypothesis] = []
    try:
        roots = await backend.roots(tokens, GREEDY, used)
        held.update(roots)
        peak = len(held)
        first = await roots[0].candidates(2 * width)
        beams = [_Beam(roots[0], _Recorder(), 0.0, first)]
        for step in range(max_tokens):
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
            # Where the new beams go is the backend's business (a pool
            # spreads them over its workers); what no new beam continues
            # is pruned before they are made.
            lanes = [beam.branch for beam in beams]
            made, copied = await backend.children(
                lanes, [c[1] for c in chosen], workers=used, share=share
            )
            moved += copied
            held = {b for b in made if not isinstance(b, BaseException)}  # before any raise
            pending: list[tuple[Lane, int, float, _Recorder]] = []
            for (score, _, t, *_), (_, rec), branch in zip(chosen, recs, made, strict=True):
                if isinstance(branch, WorkerLostError):
                    lost += 1
                elif isinstance(branch, BaseException):
                    raise branch
                else:
                    pending.append((branch, t, score, rec))
            peak = max(peak, len(held) + backend.deferred())
            new_beams: list[_Beam] = []
            # One decode (per worker) for every beam's token.
            tops = await gather(*(b.advance(t, top=2 * width) for b, t, *_ in pending))
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
        await backend.release(held)
    ranked = _ranked(finished + final, width, length_penalty)
    beams_out = tuple([await rec.finish(backend) for _, rec in ranked])
    return BeamSearch(
        beams_out[0],
        beams_out,
        tuple(score for score, _ in ranked),
        max(0, await backend.decodes() - before),
        peak,
        time.perf_counter() - started,
        moved,
        lost,
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
