"""lloyal.agents: the tool loop, diverge, fan_out and chain against real models."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import lloyal
import pytest
from lloyal.agents import Agent, Event, chain, diverge, fan_out, tool


@tool
def add(a: int, b: int) -> int:
    "Add two integers."
    return a + b


@tool
async def fail(a: int) -> int:
    "Always fails."
    raise RuntimeError("the service is down")


def _template(ctx: lloyal.Context) -> str | None:
    # The Gemma 3 test model's GGUF has no template: the built-in one.
    return None if ctx.chat_template else "gemma"


def test_a_required_tool_call_runs_and_its_result_goes_back(model: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(model, n_ctx=2048) as ctx:
            events: list[Event] = []
            agent = Agent(
                ctx,
                tools=[add],
                tool_choice="required",
                params=lloyal.GREEDY,
                template=_template(ctx),
                max_tokens=48,
                on_event=events.append,
            )
            result = await agent.run("What is 2 plus 3?")
            name, arguments, value = result.calls[0]
            assert name == "add"
            assert value == arguments["a"] + arguments["b"]
            kinds = [e.kind for e in events]
            assert kinds[:3] == ["reply", "tool_call", "tool_result"]
            assert kinds[-1] == "answer" or not result.finished
            assert all(e.agent == "agent" for e in events)
            # The chat holds the call and its result.
            roles = [m["role"] for m in result.messages]
            assert roles[:3] == ["user", "assistant", "tool"]
            assert result.messages[1]["tool_calls"][0]["function"]["name"] == "add"
            assert result.messages[2]["content"] == str(value)
            assert lloyal.BranchStore(ctx).available == ctx.n_seq_max  # the session closed

    asyncio.run(main())


def test_a_failing_tool_reports_the_error_to_the_model(smollm2: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=2048) as ctx:
            events: list[Event] = []
            agent = Agent(
                ctx,
                tools=[fail],
                tool_choice="required",
                params=lloyal.GREEDY,
                max_turns=2,
                max_tokens=32,
                on_event=events.append,
            )
            result = await agent.run("Call the tool with 1.")
            errors = [e for e in events if e.kind == "error"]
            assert errors
            assert "the service is down" in errors[0].data["error"]
            tool_message = next(m for m in result.messages if m["role"] == "tool")
            assert "the service is down" in tool_message["content"]
            assert result.calls == []

    asyncio.run(main())


def test_diverge_forks_the_task_once_and_keeps_the_best(smollm2: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=5) as ctx:
            agent = Agent(ctx, params=lloyal.SamplingParams(temperature=1.5), max_tokens=12)
            before = ctx.stats
            out = await diverge(agent, "Name a colour.", 4, lambda r: len(r.answer), seed=3)
            after = ctx.stats
            assert len(out.results) == 4
            assert out.scores == [len(r.answer) for r in out.results]
            assert out.answer is out.results[out.best]
            assert out.scores[out.best] == max(out.scores)
            # The four attempts commit together: several tokens per decode.
            calls = after.decode_calls - before.decode_calls
            assert calls * 2 < after.tokens_decoded - before.tokens_decoded
            assert len({r.answer for r in out.results}) > 1  # reseeded forks differ
            assert lloyal.BranchStore(ctx).available == 5
            with pytest.raises(ValueError, match="leases"):
                await diverge(agent, "Name a colour.", 5, lambda r: 0.0)

    asyncio.run(main())


def test_fan_out_in_task_order_and_chain_passes_the_answer_on(smollm2: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=2048, n_seq_max=3) as ctx:
            agent = Agent(ctx, params=lloyal.GREEDY, max_tokens=8)
            tasks = ["Name a fruit.", "Name a city.", "Name a river."]
            fanned = await fan_out(agent, tasks)
            alone = [await agent.run(t) for t in tasks]
            assert [r.messages[0]["content"] for r in fanned] == tasks
            assert all(r.answer for r in fanned)
            assert len(alone) == 3
            chained = await chain(agent, ["Name a fruit.", "Say this word twice: {previous}"])
            first, second = chained
            assert second.messages[0]["content"] == f"Say this word twice: {first.answer}"

    asyncio.run(main())


def test_bad_agents_are_refused() -> None:
    ctx: Any = object()
    with pytest.raises(ValueError, match="tool_choice"):
        Agent(ctx, tool_choice="always")
    with pytest.raises(TypeError, match="Tool"):
        Agent(ctx, tools=[len])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_turns"):
        Agent(ctx, max_turns=0)

    def listy(xs: list[int]) -> int:
        return len(xs)

    with pytest.raises(TypeError, match="annotation"):
        tool(listy)

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    # No annotation: a string.
    assert tool(untyped).parameters["properties"] == {"x": {"type": "string"}}
