"""Tools from MCP servers for :mod:`lloyal.agents`, through the official
``mcp`` SDK (``pip install 'lloyal[mcp]'``).

:func:`mcp_tools` connects to one server (a command run over stdio, or a
streamable-HTTP URL), lists its tools and gives each as a
:class:`~lloyal.agents.Tool`: its JSON schema becomes the model's
tool-call grammar as a Python tool's does, and calling it calls the
server. A tool server that fails, answers with an error, hangs past
``call_timeout`` or dies gives the model an error to read (the agent goes on);
a result longer than ``max_chars`` is cut, and says so.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio

from lloyal._tool import Tool

__all__ = ["MCPToolError", "mcp_tools"]

MAX_CHARS = 16_000
"""A tool result's most characters the model is shown by default."""


class MCPToolError(RuntimeError):
    """An MCP tool call that failed: the server said so, timed out, or is
    gone. The agent turns it into an error the model reads."""


@contextlib.asynccontextmanager
async def mcp_tools(
    server: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    call_timeout: float = 30.0,
    max_chars: int = MAX_CHARS,
    only: Sequence[str] | None = None,
) -> AsyncIterator[list[Tool]]:
    """The tools of the MCP server ``server``, open for the block: a URL
    (``http://...``: streamable HTTP) or a command (a list, or a string
    split as a shell would; run as a subprocess speaking stdio, with
    ``env``). ``call_timeout``: seconds a call may take; ``max_chars``: the most
    of a result the model sees; ``only``: the names to take.

    >>> import asyncio, sys
    >>> from lloyal.agents import mcp_tools
    >>> async def main():
    ...     server = [sys.executable, "-m", "lloyal._mcp_demo"]
    ...     async with mcp_tools(server) as tools:
    ...         add = next(t for t in tools if t.name == "add")
    ...         return sorted(t.name for t in tools)[:2], await add.call({"a": 2, "b": 3})
    >>> asyncio.run(main())
    (['add', 'big'], '5')
    """
    try:
        from mcp import Client, StdioServerParameters
    except ImportError as e:  # pragma: no cover - the optional extra
        raise ImportError(f"MCP tools need pip install 'lloyal[mcp]' ({e})") from None
    if call_timeout <= 0 or max_chars < 1:
        raise ValueError("call_timeout must be > 0 and max_chars >= 1")
    if isinstance(server, str) and server.startswith(("http://", "https://")):
        target: Any = server
    else:
        argv = shlex.split(server) if isinstance(server, str) else list(server)
        if not argv:
            raise ValueError("server must be a URL or a command")
        target = StdioServerParameters(
            command=argv[0], args=argv[1:], env=dict(env) if env else None
        )
    try:
        client_cm = Client(target, read_timeout_seconds=call_timeout)
        client = await client_cm.__aenter__()
    except Exception as e:
        raise MCPToolError(f"the MCP server {server!r} could not be reached: {e}") from e
    try:
        try:
            with anyio.fail_after(call_timeout):
                listed = await client.list_tools()
        except Exception as e:
            raise MCPToolError(f"the MCP server {server!r} did not list its tools: {e}") from e
        tools = [
            _tool(client, t, call_timeout, max_chars)
            for t in listed.tools
            if only is None or t.name in only
        ]
        yield tools
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await client_cm.__aexit__(None, None, None)


def _tool(client: Any, spec: Any, timeout: float, max_chars: int) -> Tool:
    schema = dict(spec.input_schema or {"type": "object"})

    async def call(**arguments: Any) -> str:
        try:
            with anyio.fail_after(timeout):
                result = await client.call_tool(spec.name, arguments)
        except TimeoutError:
            raise MCPToolError(f"{spec.name} took longer than {timeout:g} s") from None
        except Exception as e:
            raise MCPToolError(f"{spec.name} failed: {e}") from None
        text = _text(result)
        if result.is_error:
            raise MCPToolError(f"{spec.name}: {text or 'the tool reported an error'}")
        if len(text) > max_chars:
            cut = len(text) - max_chars
            text = text[:max_chars] + f"\n[{cut} more characters cut]"
        return text

    return Tool(spec.name, spec.description or spec.name, schema, call)


def _text(result: Any) -> str:
    """A call result as text: its text parts, else its structured content
    as JSON; other parts (images, resources) by their kind."""
    parts = []
    for part in result.content or []:
        if getattr(part, "type", None) == "text":
            parts.append(part.text)
        else:
            parts.append(f"[{getattr(part, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)
