"""One choice of a request between the engine's steps: its text as it
streams, its stop strings and limit, and how it ends; and the events it
sends to its request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from lloyal.branch import Branch, Produced
from lloyal.chat.budget import ReasoningBudget
from lloyal.context import Context
from lloyal.errors import LloyalError
from lloyal.server._protocol import Generation
from lloyal.server._speculation import Drafts
from lloyal.text import TextStream

log = logging.getLogger("lloyal.server")


@dataclass(frozen=True)
class Event:
    """A step of one choice: text to send (stop strings already cut), the
    token it came with and its log-probabilities, or the end."""

    index: int
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    finish: str | None = None
    # On a request's first event only: how many of its prompt tokens came
    # from the prefix cache, not decoded (``cached_tokens`` in its usage).
    cached: int | None = None
    # On a finish: the stop string that ended the choice, if one did.
    stop: str | None = None


@dataclass
class Metrics:
    requests: int = 0
    rejected: int = 0
    active: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    disconnects: int = 0
    # Prompts cut and replies reseeded by context shift.
    context_shifts: int = 0
    # Prompt lookup speculation: tokens drafted, and kept.
    spec_drafted: int = 0
    spec_accepted: int = 0
    started: float = field(default_factory=time.time)


class Choice:
    """One choice's state between steps: its text, stop strings, limit."""

    def __init__(
        self,
        ctx: Context,
        metrics: Metrics,
        index: int,
        branch: Branch,
        gen: Generation,
        limit: int,
        start: int,
        stop_tokens: set[int],
        preserved: set[int],
        events: asyncio.Queue[Event],
    ) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.index = index
        self.branch = branch
        self.gen = gen
        self.limit = limit
        self.start = start  # the branch's position after the prompt
        # Positions a context shift dropped (``Engine._shift``): the branch
        # holds start + len(committed) - dropped tokens.
        self.dropped = 0
        self.stop_tokens = stop_tokens
        self.preserved = preserved
        self.events = events
        self.stream = TextStream(ctx)
        self.held = ""  # text that may be the start of a stop string
        self.made = 0
        # The tokens decoded into the branch after the prompt.
        self.committed: list[int] = []
        # A token chosen but not committed yet (see ``Engine._start``).
        self.next: int | None = None
        # The reasoning budget of a chat request that has one.
        self.budget: ReasoningBudget | None = None
        self.joined = False
        self.cancelled = False
        self.failed = False
        # Set once the step loop no longer touches the branch.
        self.released = asyncio.Event()
        # While the step loop still works on the branch after the choice
        # ended (a speculative round truncating its rejected drafts), the
        # release waits for it: see ``holding``.
        self._holding = False
        self._release_due = False
        # The prompt as decoded (context shift reseeds from it).
        self.prompt: list[int] = []
        # Prompt lookup drafting (``lloyal.server._speculation``), if any.
        self.drafts: Drafts | None = None

    def released_if_cancelled(self) -> bool:
        if self.cancelled:
            self.released.set()
        return self.cancelled

    def decide(
        self, p: Produced, lp: tuple[float, list[int], list[float]] | None = None
    ) -> int | None:
        """Send the token ``p`` chose; the token to commit this step, or
        None when the choice ends with it. A token is streamed as soon as
        it is chosen, and the last one is never decoded (nothing would
        read its logits): what llama-server does too. ``lp`` is the token's
        logprob entry when the request asked for logprobs (see
        ``Engine._decide``)."""
        forced = False
        if self.budget is not None:
            token = self.budget.choose(p.token)
            if token != p.token:  # the end of the reasoning, written for the model
                # (No logprob entry: the model did not choose it.)
                p, lp, forced = Produced(token, "", False), None, True
        ends = (p.is_stop or p.token in self.stop_tokens) and not forced
        if ends and not self.gen.ignore_eos:
            self.end("stop")
            return None
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if lp is not None:
            logprob, ids, lps = lp
            top = tuple(zip(ids, lps, strict=True))
        event = Event(self.index, "", p.token, logprob, top)
        self.metrics.completion_tokens += 1
        self.made += 1
        ctx = self.ctx
        if p.token in self.preserved:
            piece = self.stream.flush() + ctx.token_to_text(p.token, render_special=True)
        else:
            piece = self.stream.push(p.token)
        self.held += piece
        stops = self.gen.stop
        cut = _first_stop(self.held, stops)
        if cut is not None:
            self.events.put_nowait(replace(event, text=self.held[:cut]))
            matched = _stop_at(self.held, stops, cut)
            self.held = ""
            self.end("stop", matched)
            return None
        keep = _partial_stop(self.held, stops)
        ready, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.events.put_nowait(replace(event, text=ready))
        if self.made >= self.limit:
            self.end("length")
            return None
        return p.token

    def expected_position(self) -> int:
        """Where the branch is when every committed token is in it."""
        return self.start + len(self.committed) - self.dropped

    def position(self) -> int:
        """The branch's position; -1 once it cannot be read."""
        try:
            return self.branch.position
        except Exception:
            return -1

    def end(self, finish: str, stop: str | None = None) -> None:
        """Send what is held back and the finish (``stop``: the stop string
        that ended it); release the branch."""
        text = self.held + self.stream.flush()
        self.held = ""
        cut = _first_stop(text, self.gen.stop)
        if cut is not None:
            finish, stop = "stop", _stop_at(text, self.gen.stop, cut)
        if text:
            self.events.put_nowait(Event(self.index, text if cut is None else text[:cut]))
        self.events.put_nowait(Event(self.index, finish=finish, stop=stop))
        self._release()

    def fail(self, error: BaseException, what: str = "generation failed for this request") -> None:
        """End with an error (its request gets a 500); release the branch,
        which is not kept in the prefix cache."""
        if not isinstance(error, LloyalError):  # not the model's or grammar's doing: a bug
            log.error("a request failed in the step loop", exc_info=error)
        self.failed = True
        self.events.put_nowait(Event(self.index, text=f"{what}: {error}", finish="error"))
        self._release()

    def _release(self) -> None:
        if self._holding:
            self._release_due = True
        else:
            self.released.set()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Keep the branch the step loop's while the block runs, even if
        the choice ends in it (its request prunes or caches the branch
        once released)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            if self._release_due:
                self.released.set()


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_at(text: str, stops: Sequence[str], cut: int) -> str:
    """The stop string found at ``cut`` (:func:`_first_stop`'s answer)."""
    return next(s for s in stops if s and text.startswith(s, cut))


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
