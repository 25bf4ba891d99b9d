"""Chat turns in a program: ``s += lloyal.user("...")`` appends the text the
model's chat template gives that turn.

A turn's text is what rendering the chat with it adds to rendering the chat
without it, so a program's text is exactly what the template renders for the
same messages (for templates that only ever append, which covers ChatML,
Gemma, Llama 3 and the other families lloyal ships). An assistant turn with
no content is left open: what the program appends and generates next is its
content, and the next turn (or the end of the program's text) closes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["Turn", "assistant", "system", "user"]


@dataclass(frozen=True)
class Turn:
    """One chat turn to append to a program's state (see :func:`user`).
    ``content=None`` (assistants only) opens the turn for generation."""

    role: str
    content: str | None


def system(content: str) -> Turn:
    """A system turn: ``s += lloyal.system("You are terse.")``.

    >>> import lloyal
    >>> lloyal.system("Be brief.")
    Turn(role='system', content='Be brief.')
    """
    return Turn("system", _text(content, "system"))


def user(content: str) -> Turn:
    """A user turn: ``s += lloyal.user("What is 2 + 2?")``.

    >>> import lloyal
    >>> lloyal.user("Hi").role
    'user'
    """
    return Turn("user", _text(content, "user"))


def assistant(content: str | None = None) -> Turn:
    """An assistant turn. With ``content``, a finished turn (a few-shot
    example); without, the turn is opened (the template's generation
    prompt) and what follows is its content, typically ``await s.gen(...)``,
    until the next turn closes it.

    >>> import lloyal
    >>> lloyal.assistant().content is None
    True
    """
    return Turn("assistant", None if content is None else _text(content, "assistant"))


def _text(content: object, role: str) -> str:
    if not isinstance(content, str):
        raise TypeError(f"{role}() content must be a str, got {type(content).__name__}")
    return content


class Chat:
    """The messages of a program's state and the text their turns rendered
    to, kept so that each new turn's text is a difference of two renders."""

    def __init__(self, template: str | None = None) -> None:
        self.template = template
        self.messages: list[dict[str, Any]] = []
        # The text of the open assistant turn so far (None: no turn is open).
        self.open: str | None = None

    def copy(self) -> Chat:
        other = Chat(self.template)
        other.messages = [dict(m) for m in self.messages]
        other.open = self.open
        return other

    def append_text(self, text: str) -> None:
        """Plain text appended while an assistant turn is open is its content."""
        if self.open is not None:
            self.open += text

    def turn_text(self, ctx: Context, turn: Turn) -> str:
        """The text ``turn`` adds to the chat (closing an open assistant
        turn first), and record it."""
        out = self.close(ctx)
        before = self._render(ctx, self.messages, prompt=False)
        if turn.content is None:
            after = self._render(ctx, self.messages, prompt=True)
            self.open = ""
        else:
            self.messages.append({"role": turn.role, "content": turn.content})
            after = self._render(ctx, self.messages, prompt=False)
        return out + _difference(before, after, turn.role)

    def close(self, ctx: Context) -> str:
        """The text that closes an open assistant turn ("" if none is open)."""
        if self.open is None:
            return ""
        content, self.open = self.open, None
        known = self._render(ctx, self.messages, prompt=True) + content
        self.messages.append({"role": "assistant", "content": content})
        after = self._render(ctx, self.messages, prompt=False)
        if after.startswith(known):
            return after[len(known) :]
        # The template reformats the content (trims it, say): the closing is
        # what follows the content where the template put it.
        at = after.rfind(content.strip())
        return after[at + len(content.strip()) :] if at >= 0 and content.strip() else ""

    def _render(self, ctx: Context, messages: list[dict[str, Any]], *, prompt: bool) -> str:
        if not messages and not prompt:
            return ""
        return ctx.format_chat(
            messages, add_generation_prompt=prompt, template=self.template
        ).prompt


def _difference(before: str, after: str, role: str) -> str:
    if not after.startswith(before):
        raise ValueError(
            f"the chat template rewrites earlier text when a {role} turn is added, so the "
            "turn cannot be appended to text already decoded; append the text yourself "
            "(s += '...') or start the program with this turn"
        )
    return after[len(before) :]
