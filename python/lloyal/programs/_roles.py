"""Chat turns in a program: ``s += lloyal.user("...")`` appends the text the
model's chat template gives that turn.

A turn's text is what rendering the chat with it adds to rendering the chat
without it, so a program's text is exactly what the template renders for the
same messages. An assistant turn with no content is left open: what the
program appends and generates next is its content, and the next turn closes
it. A template that rewrites earlier text when a turn is added (one that
drops old reasoning, or trims a reply) is handled as :class:`lloyal.Session`
handles it: the state's text from its first turn becomes the new render, and
the branch keeps the longest prefix it holds and re-decodes from the first
changed token (:class:`lloyal._held.Held`). That needs the text since the
first turn to be the chat's alone: after plain text appended outside an open
assistant turn, such a template raises ``ValueError``.
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
    """The messages of a program's state, the open assistant turn, and
    where the chat's text begins in the state's text."""

    def __init__(self, template: str | None = None) -> None:
        self.template = template
        self.messages: list[dict[str, Any]] = []
        # The text of the open assistant turn so far (None: no turn is open).
        self.open: str | None = None
        # Where the first turn's text begins: (characters, bytes) into the
        # state's text and what its branch holds; None before it.
        self.start: tuple[int, int] | None = None
        # Text appended outside an open assistant turn since then: the
        # state's text from `start` is no longer the rendered chat alone.
        self.loose = False

    def copy(self) -> Chat:
        other = Chat(self.template)
        other.messages = [dict(m) for m in self.messages]
        other.open = self.open
        other.start = self.start
        other.loose = self.loose
        return other

    def append_text(self, text: str) -> None:
        """Plain text appended while an assistant turn is open is its
        content; elsewhere after the first turn, it is the program's own."""
        if self.open is not None:
            self.open += text
        elif self.start is not None and text:
            self.loose = True

    def add(self, ctx: Context, turn: Turn) -> tuple[str | None, str]:
        """Record ``turn`` (closing an open assistant turn first). Returns
        the text it adds when the chat's text only grew (None when the
        template rewrote earlier text) and the whole chat rendered now.
        ``ValueError`` (nothing recorded) when the template rewrites text
        and the state has text of its own inside the chat (``loose``)."""
        messages = [dict(m) for m in self.messages]
        grew = True
        added = ""
        if self.open is not None:
            known = self._render(ctx, messages, prompt=True) + self.open
            messages.append({"role": "assistant", "content": self.open})
            closed = self._render(ctx, messages, prompt=False)
            if closed.startswith(known):
                added = closed[len(known) :]
            elif self.loose:
                # The template reformats the content (trims it, say): the
                # closing is what follows the content where it was put.
                content = self.open.strip()
                at = closed.rfind(content)
                added = closed[at + len(content) :] if at >= 0 and content else ""
            else:
                grew = False
        before = self._render(ctx, messages, prompt=False)
        if turn.content is None:
            after = self._render(ctx, messages, prompt=True)
        else:
            messages.append({"role": turn.role, "content": turn.content})
            after = self._render(ctx, messages, prompt=False)
        if not after.startswith(before):
            if self.loose:
                raise ValueError(
                    f"the chat template rewrites earlier text when a {turn.role} turn is "
                    "added, and this state has text of its own between its turns, so the "
                    "chat cannot be rendered again; append the text yourself (s += '...') or "
                    "keep plain text out of a chat"
                )
            grew = False
        self.messages = messages
        self.open = "" if turn.content is None else None
        return (added + after[len(before) :] if grew else None), after

    def _render(self, ctx: Context, messages: list[dict[str, Any]], *, prompt: bool) -> str:
        if not messages and not prompt:
            return ""
        return ctx.format_chat(
            messages, add_generation_prompt=prompt, template=self.template
        ).prompt
