"""What every strategy shares: prompt and argument checks, the per-token
record of a continuation (:class:`Continuation`), log-softmax and
entropy, and pruning that survives cancellation."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore
from lloyal.context import Context
from lloyal.errors import BranchBusyError

Prompt = str | Sequence[int]
"""Text (tokenized with the model's BOS rule) or token ids."""

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` after each step of a long search."""

Score = Callable[[str], float | Awaitable[float]]
"""Scores a generated text (higher is better); may be a coroutine function."""

_F64 = npt.NDArray[np.float64]


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


def _softmax(logits: npt.ArrayLike, temperature: float) -> _F64:
    x = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(x - np.max(x))
    out: _F64 = e / e.sum()
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


class _Detokenizer(Protocol):
    async def detokenize(self, tokens: list[int]) -> str: ...


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

    async def finish(self, source: _Detokenizer) -> Continuation:
        """As a :class:`Continuation`, its text from ``source`` (a context,
        or a strategy backend)."""
        return Continuation(
            await source.detokenize(self.tokens),
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
