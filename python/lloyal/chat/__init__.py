"""Chat: prompts in a model's template, tool calls and structured replies,
and reading the reply back.

- :mod:`lloyal.chat.format`: what :meth:`Context.format_chat` renders with
  tools or a JSON schema (the family's grammar, lazy triggers, messages a
  template without tools can show), and the message and tool checks.
- :mod:`lloyal.chat.prompt`: :class:`ChatPrompt`, what
  :meth:`Context.format_chat` returns.
- :mod:`lloyal.chat.budget`: :class:`ReasoningBudget`, at most so many
  tokens of reasoning, then the end-of-thinking marker is written.
- :mod:`lloyal.chat.output`: :func:`parse_chat_output` and
  :class:`ChatOutputStream` split a reply into content, reasoning and tool
  calls.
- ``_families``: each format in one row (how a template that speaks it is
  recognised, its markers, the grammar that forces a call, its parser);
  ``_markers`` (each family's markers, written once), ``_types`` (what a
  parsed reply is), ``_scan`` (the partial-JSON scanner and call objects)
  ``_blocks`` and ``_tagged`` (each family's block parser) are its parts.

>>> from lloyal.chat import parse_chat_output
>>> parse_chat_output("<think>Easy.</think>Paris.").reasoning
'Easy.'
"""

from lloyal.chat.budget import ReasoningBudget
from lloyal.chat.format import ToolSpec, check_messages, check_tools, prepare_chat
from lloyal.chat.output import (
    CHAT_FORMATS,
    ChatOutput,
    ChatOutputStream,
    ToolCall,
    parse_chat_output,
)
from lloyal.chat.prompt import ChatPrompt

__all__ = [
    "CHAT_FORMATS",
    "ChatOutput",
    "ChatOutputStream",
    "ChatPrompt",
    "ReasoningBudget",
    "ToolCall",
    "ToolSpec",
    "check_messages",
    "check_tools",
    "parse_chat_output",
    "prepare_chat",
]
