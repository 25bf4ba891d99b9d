"""A rendered chat prompt (:meth:`lloyal.Context.format_chat`): the text,
the tokens that end the turn, and what the reply should look like."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from lloyal.chat._families import FAMILIES
from lloyal.chat._markers import THINKING
from lloyal.chat.budget import ReasoningBudget, Tokenizer
from lloyal.chat.output import ChatOutput, parse_chat_output
from lloyal.grammar import Grammar
from lloyal.media import Media

__all__ = ["ChatPrompt"]


class _GrammarMaker(Protocol):
    """What compiling a prompt's grammar needs of a :class:`~lloyal.Context`."""

    def create_grammar(
        self, *, lark: str | None = None, triggers: Sequence[str] | None = None
    ) -> Grammar | None: ...


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt.

    ``stop_tokens`` are the tokens that end the assistant's turn (the
    model's end-of-generation token plus the template's end-of-turn marker);
    ``template_source`` says which template rendered it: ``"model"`` (the
    GGUF's own), a built-in name, or ``"custom"``.

    With ``tools=`` or ``json_schema=``, ``grammar`` is the Lark grammar
    for the reply and ``grammar_triggers`` the words that arm it (empty:
    it applies from the first token); :meth:`create_grammar` compiles it.
    ``chat_format`` names the tool-call convention the reply should follow
    (:func:`lloyal.parse_chat_output` reads it); ``preserved_tokens`` are
    the markers of that convention that are special tokens of this model
    (render them when detokenizing, or the parser never sees them);
    ``thinking_started`` says the prompt already opened a ``<think>`` block.
    ``media`` are the images and audio of the messages, one per
    :data:`MEDIA_MARKER <lloyal.MEDIA_MARKER>` in ``prompt``, in order.
    """

    prompt: str
    stop_tokens: tuple[int, ...]
    template_source: str
    chat_format: str = "content"
    grammar: str | None = None
    grammar_triggers: tuple[str, ...] = ()
    preserved_tokens: tuple[int, ...] = ()
    thinking_started: bool = False
    # What opens and closes reasoning in this prompt's family.
    think: tuple[str, str] = THINKING
    # The images and audio of the messages, one per media marker, in order.
    media: tuple[Media, ...] = ()

    def reasoning_budget(self, ctx: Tokenizer, budget: int) -> ReasoningBudget:
        """A :class:`ReasoningBudget` for a reply to this prompt: at most
        ``budget`` tokens of reasoning (negative: no limit)."""
        return ReasoningBudget(
            ctx, budget, think=self.think, thinking_started=self.thinking_started
        )

    def create_grammar(self, ctx: _GrammarMaker) -> Grammar | None:
        """The reply's grammar compiled for ``ctx`` (lazy when it has
        triggers), or ``None`` when there is none."""
        if self.grammar is None:
            return None
        return ctx.create_grammar(lark=self.grammar, triggers=self.grammar_triggers or None)

    def parse(self, text: str, *, partial: bool = False) -> ChatOutput:
        """Read a reply to this prompt: content, reasoning and tool calls
        (:func:`lloyal.parse_chat_output` with this prompt's format)."""
        return parse_chat_output(
            text,
            format=self.chat_format,
            partial=partial,
            thinking_started=self.thinking_started,
        )

    def parse_cut(self, text: str) -> ChatOutput:
        """Read a reply that ``max_tokens`` cut off: as :meth:`parse`, except
        that a tool call the cut fell inside stays a call, with the
        arguments it got (what OpenAI and Anthropic report), and a call's
        markup cut before it named its function is left out rather than
        taken for content. Text that merely could have begun a marker
        stays content.

        >>> from lloyal.chat.prompt import ChatPrompt
        >>> p = ChatPrompt("", (), "", chat_format="hermes")
        >>> p.parse_cut('<tool_call>\\n{"name": "get_weather", "arguments": {"ci').tool_calls
        (ToolCall(name='get_weather', arguments='{"ci', id=None),)
        >>> p.parse_cut('<tool_call>\\n{"na').content, p.parse_cut("1 < 2 <").content
        ('', '1 < 2 <')
        """
        whole = self.parse(text)
        cut = self.parse(text, partial=True)
        if len(cut.tool_calls) > len(whole.tool_calls):
            return cut
        family = FAMILIES.get(self.chat_format)
        markers = family.markers if family is not None else ()
        if whole.content.startswith(cut.content):
            tail = whole.content[len(cut.content) :]
            if any(m and m in tail for m in markers):
                return cut
        return whole
