"""A small MCP server for :func:`lloyal.agents.mcp_tools`' examples and
tests: ``python -m lloyal._mcp_demo`` serves it over stdio,
``python -m lloyal._mcp_demo --http PORT`` over streamable HTTP on
127.0.0.1. Its tools: ``add``, ``weather``, and the misbehaving ``big``
(a 1 MB result), ``fail`` (an error), ``hang`` (never answers) and
``crash`` (the server exits)."""

from __future__ import annotations

import os
import sys
import time

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("lloyal-demo")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def weather(city: str) -> str:
    """The weather in a city now."""
    return f"Sunny, 21 C in {city}"


@server.tool()
def big() -> str:
    """A 1 MB answer."""
    return "x" * (1 << 20)


@server.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ToolError(f"failed on purpose: {reason}")


@server.tool()
def hang() -> str:
    """Never answers."""
    time.sleep(3600)
    return ""


@server.tool()
def crash() -> str:
    """Ends the server process."""
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
