"""A function the model may call, as :mod:`lloyal.agents` and its MCP
tools (``lloyal._mcp``) both make them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Tool"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description, JSON-schema
    parameters, and the Python callable (sync or async) that runs it."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style tool entry ``format_chat(tools=...)`` takes."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    async def call(self, arguments: Mapping[str, Any]) -> Any:
        out = self.fn(**arguments)
        return await out if inspect.isawaitable(out) else out
