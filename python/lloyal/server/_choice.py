"""One choice of a request between the engine's steps: its text as it
streams, its stop strings and limit, and how it ends; and the events it
sends to its request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from lloyal._generation import Generation
from lloyal.branch import Branch, Produced
from lloyal.chat.budget import ReasoningBudget
from lloyal.context import Context
from lloyal.errors import LloyalError
from lloyal.server._protocol import RequestOptions
from lloyal.server._speculation import Drafts

log = logging.getLogger("lloyal.server")


@dataclass(frozen=True)
class ChoiceEvent:
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


@dataclass(frozen=True)
class Ending:
    """What ends a request's choices besides its options: the chat's stop
    tokens, the tokens shown as written (its preserved tokens), and a
    reasoning budget for each choice."""

    stop_tokens: frozenset[int] = frozenset()
    preserved: frozenset[int] = frozenset()
    budget: Callable[[], ReasoningBudget] | None = None


class Choice:
    """One choice's state between steps: its text, stop strings, limit."""

    def __init__(
        self,
        ctx: Context,
        metrics: Metrics,
        index: int,
        branch: Branch,
        gen: RequestOptions,
        limit: int,
        start: int,
        events: asyncio.Queue[ChoiceEvent],
        ending: Ending,
    ) -> None:
        self.ctx = ctx
        self.metrics = metrics
        self.index = index
        self.branch = branch
        self.gen = gen
        self.limit = limit
        self.start = start  # the branch's position after the prompt
        # Positions a context shift dropped (``Scheduler._shift``): the branch
        # holds start + len(committed) - dropped tokens.
        self.dropped = 0
        self.events = events
        # The reasoning budget of a chat request that has one.
        self.budget = ending.budget() if ending.budget is not None else None
        # Stop tokens and strings, what is shown, when it ends.
        self.generation = Generation(
            ctx,
            max_tokens=limit,
            stop=gen.stop,
            stop_tokens=ending.stop_tokens,
            preserved=ending.preserved,
            budget=self.budget,
            ignore_eos=gen.ignore_eos,
        )
        # The tokens decoded into the branch after the prompt.
        self.committed: list[int] = []
        # A token chosen but not committed yet (see ``Scheduler._start``).
        self.next: int | None = None
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

    @property
    def made(self) -> int:
        """How many tokens the choice has produced."""
        return len(self.generation.tokens)

    def decide(
        self, p: Produced, lp: tuple[float, list[int], list[float]] | None = None
    ) -> int | None:
        """Send the token ``p`` chose; the token to commit this step, or
        None when the choice ends with it. A token is streamed as soon as
        it is chosen, and the last one is never decoded (nothing would
        read its logits): what llama-server does too. ``lp`` is the token's
        logprob entry when the request asked for logprobs (see
        ``Scheduler._decide``)."""
        step = self.generation.feed(p.token, p.is_stop)
        if step.token is None:  # a stop token
            self._finish(step.text, "stop", None)
            return None
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if lp is not None and not step.forced:  # (the model did not choose a forced token)
            logprob, ids, lps = lp
            top = tuple(zip(ids, lps, strict=True))
        self.metrics.completion_tokens += 1
        self.events.put_nowait(ChoiceEvent(self.index, step.text, step.token, logprob, top))
        if step.finish is not None:
            self._finish("", step.finish, step.stop)
            return None
        return step.token

    def expected_position(self) -> int:
        """Where the branch is when every committed token is in it."""
        return self.start + len(self.committed) - self.dropped

    def end(self, finish: str) -> None:
        """End now (``finish``: why), sending the text held back; release
        the branch."""
        step = self.generation.close(finish)
        self._finish(step.text, step.finish or finish, step.stop)

    def _finish(self, text: str, finish: str, stop: str | None) -> None:
        if text:
            self.events.put_nowait(ChoiceEvent(self.index, text))
        self.events.put_nowait(ChoiceEvent(self.index, finish=finish, stop=stop))
        self._release()

    def fail(self, error: BaseException, what: str = "generation failed for this request") -> None:
        """End with an error (its request gets a 500); release the branch,
        which is not kept in the prefix cache."""
        if not isinstance(error, LloyalError):  # not the model's or grammar's doing: a bug
            log.error("a request failed in the step loop", exc_info=error)
        self.failed = True
        self.events.put_nowait(ChoiceEvent(self.index, text=f"{what}: {error}", finish="error"))
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
