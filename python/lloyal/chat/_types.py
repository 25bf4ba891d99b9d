"""What a parsed reply is: :class:`ToolCall`, :class:`ChatOutput`, and the
formats :func:`lloyal.parse_chat_output` reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

CHAT_FORMATS: tuple[str, ...] = (
    "auto",
    "content",
    "hermes",
    "llama3",
    "mistral",
    "deepseek",
    "gemma",
    "generic",
    "qwen3-coder",
    "glm-4.5",
    "kimi-k2",
    "granite",
    "command-r",
    "gpt-oss",
)
"""The values :func:`parse_chat_output` takes as ``format``."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the function's name and its arguments as JSON text.

    ``arguments`` is the text the model wrote (a prefix of it while the
    call is still streaming, ``""`` before any of it arrived), or for calls
    written in Python syntax the ``json.dumps`` of their keyword arguments;
    ``id`` is the call id the model wrote, if any (Mistral writes one).
    """

    name: str
    arguments: str
    id: str | None = None

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or ``None`` while they are not (yet) a
        complete JSON object. Arguments written as a JSON string holding an
        object (``"{\\"a\\": 1}"``) are decoded twice."""
        try:
            value = json.loads(self.arguments, strict=False)
            if isinstance(value, str):
                value = json.loads(value, strict=False)
        except Exception:  # malformed, too deep, too long a number
            return None
        return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ChatOutput:
    """A parsed reply: the text for the user, the model's reasoning and the
    tool calls in the order it made them."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
