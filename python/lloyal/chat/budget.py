"""A reasoning budget: at most so many tokens of thinking, then the family's
end-of-thinking marker is written for the model.

A reply reasons when the prompt opened its family's reasoning marker
(``<think>``, Command-R's ``<|START_THINKING|>``, GPT-OSS's analysis
channel: :attr:`ChatPrompt.thinking_started <lloyal.ChatPrompt>`) or when
the reply starts with it. :class:`ReasoningBudget` counts the tokens the
model chose inside the reasoning; once ``budget`` of them are spent and the
model has not closed it, :meth:`ReasoningBudget.choose` returns the closing
marker's tokens one by one instead of what the model chose, then lets the
model go on (its answer, a tool call). ``budget=0`` closes the reasoning at
once; a negative budget never interferes. Session
(``generate(reasoning_budget=)``) and the server (``reasoning_budget`` in a
request, ``--reasoning-budget``) use it; a decode loop of your own calls
``choose`` with each token it is about to commit.

>>> import asyncio, lloyal
>>> async def main():
...     async with await lloyal.create_context(MODEL) as ctx:
...         budget = lloyal.ReasoningBudget(ctx, 2, thinking_started=True)
...         thought = [budget.choose(t) for t in ctx.tokenize_sync(" a b", add_special=False)]
...         forced = [budget.choose(13)]  # what the model chose is replaced...
...         while budget.forcing:  # ... until the closer is written
...             forced.append(budget.choose(13))
...         return forced == ctx.tokenize_sync("</think>", add_special=False), budget.choose(13)
>>> asyncio.run(main())
(True, 13)
"""

from __future__ import annotations

from typing import Protocol

from lloyal.chat._markers import THINKING
from lloyal.chat._scan import _held_from as _held_from_markers

__all__ = ["ReasoningBudget"]


def _held_from(text: str, marker: str) -> int:
    """Where the longest end of ``text`` that begins ``marker`` starts."""
    return _held_from_markers(text, 0, (marker,))


class Tokenizer(Protocol):
    """What a budget needs of a :class:`~lloyal.Context`."""

    def tokenize_sync(
        self, text: str, *, add_special: bool = ..., parse_special: bool = ...
    ) -> list[int]: ...

    def token_to_text(self, token: int, *, render_special: bool = ...) -> str: ...


class ReasoningBudget:
    """See the module docs. ``think`` is the family's (opener, closer)."""

    def __init__(
        self,
        ctx: Tokenizer,
        budget: int,
        *,
        think: tuple[str, str] = THINKING,
        thinking_started: bool = False,
    ) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise TypeError(f"budget must be an int, got {type(budget).__name__}")
        self._ctx = ctx
        self.budget = budget
        self._opener, self._closer = think
        # Where the reply is: "head" (it may still open its reasoning),
        # "thinking", "closing" (forcing the closer) or "done".
        self._phase = "thinking" if thinking_started else "head"
        self._text = ""  # the reply so far while it is "head" or "thinking"
        self._forced: list[int] = []
        self._last = -1
        self.spent = 0  # tokens the model chose inside its reasoning

    def choose(self, token: int) -> int:
        """The token to commit, given the one the model chose."""
        self._last = token
        if self.budget < 0 or self._phase == "done":
            return token
        if self._phase == "closing":
            return self._next_forced()
        if self._phase == "thinking" and self.spent >= self.budget:
            # What the model wrote of the closer already is not written again.
            held = len(self._text) - _held_from(self._text, self._closer)
            self._forced = self._ctx.tokenize_sync(
                self._closer[held:], add_special=False, parse_special=True
            )
            self._phase = "closing"
            return self._next_forced()
        piece = self._ctx.token_to_text(token, render_special=True)
        self._text += piece
        if self._phase == "head":
            head = self._text.lstrip()
            if head.startswith(self._opener):
                self._phase, self._text = "thinking", head[len(self._opener) :]
            elif not self._opener.startswith(head):
                self._phase = "done"
            return token
        self.spent += 1
        # Only the end can hold a closer that was not there before.
        if self._closer in self._text[-(len(piece) + len(self._closer)) :]:
            self._phase = "done"
        # The reasoning's start is not needed any more.
        self._text = self._text[-2 * len(self._closer) :]
        return token

    def _next_forced(self) -> int:
        if not self._forced:  # the model had written all of the closer
            self._phase = "done"
            return self._last
        token = self._forced.pop(0)
        if not self._forced:
            self._phase = "done"
        return token

    @property
    def forcing(self) -> bool:
        """Whether the next tokens are the closing marker's."""
        return self._phase == "closing"
