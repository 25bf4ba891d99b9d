"""One generation, from each produced token to the text it may show and
the reason it ends: written once, fed by every loop that produces until a
stop (branch iteration, sessions, programs, the server's choices,
strategies, the cluster's remote branches; agents through sessions).

It does no I/O: a loop produces a token, feeds it, and does what the
answer says (decode the token or not, show the text, end). The server,
which steps many choices in one decode, feeds it directly; the one-branch
loops use :meth:`Generation.drive`.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncGenerator, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from lloyal import _check

if TYPE_CHECKING:
    from lloyal.chat.budget import ReasoningBudget
    from lloyal.context import Context

__all__ = ["Generation", "GenerationStep"]


@dataclass(frozen=True, slots=True)
class GenerationStep:
    """What one fed token means.

    ``token``: the token that goes on (the model's, or the end of the
    reasoning written for it by a budget: ``forced``), or None when the
    generation ended without it (a stop token). ``text``: the text that is
    safe to show now (never the start of a stop string). ``finish``: None
    while the generation goes on; ``"stop"`` (a stop token or string:
    ``stop`` names the string) or ``"length"`` (``max_tokens``) when this
    step ended it, ``text`` then holding everything left to show."""

    token: int | None
    text: str
    finish: str | None = None
    stop: str | None = None
    forced: bool = False


class _Produced(Protocol):
    """A produced token (:class:`lloyal.Produced`)."""

    @property
    def token(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def is_stop(self) -> bool: ...


class _Decodes(Protocol):
    """What :meth:`Generation.drive` needs of a branch (a local
    :class:`lloyal.Branch` or a cluster's remote one)."""

    async def produce(self) -> _Produced: ...
    async def commit(self, token: int) -> None: ...


class Generation:
    """The produce-until-stop rules of one generation: stop tokens, stop
    strings (text that could begin one is held back until it cannot),
    tokens rendered as their special text (a chat's preserved tokens), a
    reasoning budget, ``max_tokens``.

    Feed it each produced token (:meth:`feed`); each answer says what to
    decode, what text to show and whether it ended. Afterwards
    :attr:`output` is the text up to the stop string that ended it,
    :attr:`tokens` the tokens it took and :attr:`kept` how many of them lie
    wholly before that stop string (what a caller that cuts the branch
    back to the text keeps). :meth:`close` ends it early (a client gone, a
    full context) with the text still held back. ``ctx`` detokenizes; a
    loop whose tokens come with their text (a remote branch) passes
    ``ctx=None`` and feeds ``text=``.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
    ...         await b.prefill(await ctx.tokenize("Count: 1, 2, 3,"))
    ...         gen = lloyal.Generation(ctx, stop=[", 6"], max_tokens=20)
    ...         shown = [s.text async for s in gen.drive(b)]
    ...         return "".join(shown), gen.finish, gen.stop
    >>> asyncio.run(main())
    (' 4, 5', 'stop', ', 6')
    """

    def __init__(
        self,
        ctx: Context | None,
        *,
        max_tokens: int | None = None,
        stop: Iterable[str] = (),
        stop_tokens: Collection[int] = (),
        preserved: Collection[int] = (),
        budget: ReasoningBudget | None = None,
        ignore_eos: bool = False,
    ) -> None:
        if max_tokens is not None:
            _check.integer(max_tokens, "max_tokens")
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError("a stop string must be a non-empty str")
        self._ctx = ctx
        self.max_tokens = max_tokens
        self.stops: tuple[str, ...] = tuple(stops)
        self._stop_tokens = stop_tokens
        self._preserved = preserved
        self._budget = budget
        self._ignore_eos = ignore_eos
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[int] = []
        # The text is kept as what was shown (pieces, joined when read) and
        # what is held, so that a token costs its own piece, not a copy of
        # the whole text.
        self._done: list[str] = []
        self._held = ""
        self._shown = 0  # len(text) shown so far
        self._length = 0  # len(text)
        # len(text) after each token (its end in ``text``).
        self.ends: list[int] = []
        self.finish: str | None = None
        self.stop: str | None = None
        # Where the stop string that ended the generation starts in ``text``.
        self.cut: int | None = None

    @property
    def text(self) -> str:
        """Everything produced so far (past a stop string too)."""
        if len(self._done) > 1:
            self._done = ["".join(self._done)]
        return (self._done[0] if self._done else "") + self._held

    @property
    def output(self) -> str:
        """The text, up to the stop string that ended it."""
        return self.text if self.cut is None else self.text[: self.cut]

    @property
    def kept(self) -> int:
        """How many of :attr:`tokens` end at or before the stop string that
        ended the generation (all of them when none did)."""
        if self.cut is None:
            return len(self.tokens)
        return sum(1 for e in self.ends if e <= self.cut)

    @property
    def held(self) -> str:
        """Text produced but not shown yet (it may begin a stop string)."""
        return self._held

    def feed(self, token: int, is_stop: bool = False, *, text: str | None = None) -> GenerationStep:
        """Take the next produced token (``is_stop``: the model's own end
        of generation; ``text``: its text, where the generation has no
        context to detokenize with).

        >>> import lloyal
        >>> gen = lloyal.Generation(None, stop=["\\n\\n"])  # text given with each token
        >>> [gen.feed(t, text=s).text for t, s in enumerate(["Hi", "\\n", "\\nmore"])]
        ['Hi', '', '']
        >>> gen.finish, gen.output, gen.kept
        ('stop', 'Hi', 1)
        """
        if self.finish is not None:
            raise RuntimeError(f"the generation has ended ({self.finish})")
        forced = False
        if self._budget is not None:
            chosen = self._budget.choose(token)
            forced = chosen != token
            token = chosen
        if not forced and not self._ignore_eos and (is_stop or token in self._stop_tokens):
            return self._end("stop", None)
        self.tokens.append(token)
        piece = self._piece(token, text)
        self._held += piece
        self._length += len(piece)
        self.ends.append(self._length)
        if self._find_stop():
            return GenerationStep(token, self._take(), "stop", self.stop, forced)
        if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            step = self._end("length", token)
            return GenerationStep(token, step.text, step.finish, step.stop, forced)
        safe = len(self._held) - _partial_stop(self._held, self.stops)
        shown, self._held = self._held[:safe], self._held[safe:]
        self._done.append(shown)
        self._shown += len(shown)
        return GenerationStep(token, shown, forced=forced)

    def close(self, finish: str = "stop") -> GenerationStep:
        """End the generation now (``finish``: why, unless a stop string
        turns up in the text still held); the step carries that text. Once
        ended, an empty step.

        >>> import lloyal
        >>> gen = lloyal.Generation(None, stop=["END"])
        >>> gen.feed(1, text="the E").text  # "E" could begin "END"
        'the '
        >>> step = gen.close("length")  # a client gone, say
        >>> step.text, step.finish, gen.output
        ('E', 'length', 'the E')
        """
        if self.finish is not None:
            return GenerationStep(None, "", self.finish, self.stop)
        return self._end(finish, None)

    async def drive(
        self,
        branch: _Decodes,
        *,
        last: Literal["decode", "skip"] | Callable[[int], object] = "decode",
    ) -> AsyncGenerator[GenerationStep, None]:
        """Produce and feed until the generation ends, yielding each step
        after its token is in the branch. A token that completes a stop
        string is not decoded; the last one of ``max_tokens`` is decoded
        (``"decode"``), left (``"skip"``: nothing reads its logits) or
        given to ``last`` (``branch.accept``: recorded as chosen, decoded
        later with what comes next). Leaving the loop early leaves every
        yielded token decoded.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await b.prefill(prompt)
        ...         gen = lloyal.Generation(ctx, max_tokens=3)
        ...         steps = [s async for s in gen.drive(b, last="skip")]
        ...         return len(steps), gen.finish, b.position - len(prompt)
        >>> asyncio.run(main())
        (3, 'length', 2)
        """
        while self.finish is None:
            p = await branch.produce()
            step = self.feed(p.token, p.is_stop, text=None if self._ctx else p.text)
            if step.token is not None:
                if step.finish is None or (step.finish == "length" and last == "decode"):
                    await branch.commit(step.token)
                elif step.finish == "length" and callable(last):
                    last(step.token)
            yield step

    # -- inside ------------------------------------------------------------------------

    def _piece(self, token: int, text: str | None) -> str:
        if text is not None:
            return self._decoder.decode(text.encode()) if text else ""
        assert self._ctx is not None, "a generation without a context is fed text="
        if token in self._preserved:
            # Shown as written, the bytes held before it first.
            held = self._decoder.decode(b"", final=True)
            self._decoder.reset()
            return held + self._ctx.token_to_text(token, render_special=True)
        return self._decoder.decode(self._ctx.token_bytes(token))

    def _find_stop(self) -> bool:
        """Whether a stop string is in the text not shown yet (one that
        began in shown text would have been held back); sets the cut."""
        held = self.held
        best: tuple[int, str] | None = None
        for s in self.stops:
            at = held.find(s)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        self.cut, self.stop, self.finish = self._shown + best[0], best[1], "stop"
        return True

    def _take(self) -> str:
        """The text left to show, up to the cut; everything is shown after."""
        end = self._length if self.cut is None else self.cut
        out = self._held[: end - self._shown]
        self._done.append(self._held)
        self._held, self._shown = "", self._length
        return out

    def _end(self, finish: str, token: int | None) -> GenerationStep:
        tail = self._decoder.decode(b"", final=True)
        if tail:
            self._held += tail
            self._length += len(tail)
            if self.ends:
                self.ends[-1] = self._length
        if not self._find_stop():
            self.finish = finish
        return GenerationStep(token, self._take(), self.finish, self.stop)


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
