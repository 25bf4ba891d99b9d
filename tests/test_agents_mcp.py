"""MCP tools for agents (:func:`lloyal.agents.mcp_tools`) through the
official ``mcp`` SDK, against the small server ``lloyal._mcp_demo`` that
the tests start themselves: over stdio, and over streamable HTTP on
loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import lloyal
import pytest
from lloyal.agents import Agent, MCPToolError, mcp_tools

from tests._hang import deadline

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

STDIO = [sys.executable, "-m", "lloyal._mcp_demo"]


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*STDIO, "--http", str(port)], stderr=subprocess.DEVNULL)
    try:
        give_up = deadline()  # a hang guard: the server starts in a second or two
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > give_up or proc.poll() is not None:
                    raise RuntimeError("the MCP demo server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait()


async def test_an_agent_calls_an_mcp_tool_over_stdio(model: Path) -> None:
    async with mcp_tools(STDIO, only=["weather"]) as tools:
        assert [t.name for t in tools] == ["weather"]
        assert tools[0].schema()["function"]["parameters"]["required"] == ["city"]
        async with await lloyal.create_context(model, n_ctx=4096) as ctx:
            # The Gemma 3 test model has no template of its own. Two turns
            # of 64 tokens: the forced call and what follows it (Gemma may
            # call again and again, which filled 2048 cells in 6 turns).
            template = None if ctx.chat_template else "gemma"
            agent = Agent(
                ctx,
                tools=tools,
                tool_choice="required",
                params=lloyal.GREEDY,
                template=template,
                max_turns=2,
                max_tokens=64,
            )
            result = await agent.run("What is the weather in Paris?")
    name, arguments, value = result.calls[0]
    assert name == "weather"
    assert value.startswith("Sunny, 21 C in ")
    assert value.endswith(arguments["city"])


async def test_tools_over_streamable_http(http_server: str) -> None:
    async with mcp_tools(http_server) as tools:
        add = next(t for t in tools if t.name == "add")
        assert await add.call({"a": 2, "b": 40}) == "42"


async def test_a_misbehaving_tool_server_is_an_error_or_a_cut_never_a_dead_agent(
    smollm2: Path,
) -> None:
    async with mcp_tools(STDIO, call_timeout=2, max_chars=1000) as tools:
        by_name = {t.name: t for t in tools}
        text = await by_name["big"].call({})
        assert text.startswith("x" * 1000)
        assert text.endswith(f"[{(1 << 20) - 1000} more characters cut]")
        with pytest.raises(MCPToolError, match="failed on purpose"):
            await by_name["fail"].call({"reason": "testing"})
        # Meant to expire, not a hang guard: `hang` never answers.
        with pytest.raises(MCPToolError, match="longer than 2 s"):
            await by_name["hang"].call({})
        assert await by_name["add"].call({"a": 1, "b": 1}) == "2"
        # In an agent, a failing tool is an error the model reads.
        async with await lloyal.create_context(smollm2, n_ctx=2048) as ctx:
            agent = Agent(ctx, tools=[by_name["fail"]], tool_choice="required", max_turns=2)
            result = await agent.run("Call fail with reason 'x'.")
        assert result.turns >= 1
        assert any("failed on purpose" in m.get("content", "") for m in result.messages)
        # A server that dies: each call fails, none hangs.
        with anyio.fail_after(60):  # a hang guard
            with pytest.raises(MCPToolError):
                await by_name["crash"].call({})
            with pytest.raises(MCPToolError):
                await by_name["add"].call({"a": 1, "b": 1})


async def test_a_server_that_cannot_start_is_a_clear_error() -> None:
    with pytest.raises(MCPToolError, match=r"could not be reached|did not list"):
        async with mcp_tools([sys.executable, "-c", "import sys; sys.exit(2)"], call_timeout=5):
            pass
    with pytest.raises(ValueError, match="URL or a command"):
        async with mcp_tools([]):
            pass
