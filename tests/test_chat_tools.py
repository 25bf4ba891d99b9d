"""Tool calls: format_chat's tools and lazy grammars, with a real model.

A lazy grammar constrains nothing until its trigger appears, then forces a
well-formed call for one of the given tools. Async tests run on asyncio.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import lloyal
import pytest
from lloyal.models import model_path

from tests.conftest import MODELS, open_sync

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TEMPLATES = {"smollm2": None, "gemma3": "gemma"}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=MODELS)
def tool_ctx(request: pytest.FixtureRequest) -> Iterator[tuple[lloyal.Context, str | None]]:
    ctx = open_sync(model_path(request.param), n_ctx=2048, n_seq_max=4)
    yield ctx, TEMPLATES[request.param]
    ctx.close()


def _check_call(call: lloyal.ToolCall) -> None:
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]
    args = call.parsed_arguments()
    assert args is not None, call
    jsonschema.validate(args, tool["function"]["parameters"])


async def _run(branch: lloyal.Branch, ctx: lloyal.Context, max_tokens: int = 80) -> str:
    stream = lloyal.TextStream(ctx)
    out = []
    for _ in range(max_tokens):
        p = await branch.produce()
        if p.is_stop:
            break
        await branch.commit(p.token)
        out.append(stream.push(p.token))
    return "".join(out) + stream.flush()


def test_templates_without_tools_get_them_in_the_system_message(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    chat = ctx.format_chat(ASK, template=template, tools=[WEATHER, CLOCK])
    assert chat.chat_format == "hermes"
    assert '"name": "get_weather"' in chat.prompt
    assert "<tool_call>" in chat.prompt
    assert chat.grammar is not None
    assert chat.grammar_triggers == ("<tool_call>",)
    required = ctx.format_chat(ASK, template=template, tools=[WEATHER], tool_choice="required")
    assert required.grammar_triggers == ()
    none = ctx.format_chat(ASK, template=template, tools=[WEATHER], tool_choice="none")
    assert none.grammar is None
    assert "get_weather" not in none.prompt
    plain = ctx.format_chat(ASK, template=template)
    assert plain.chat_format == "content"
    assert plain.grammar is None


def test_history_with_calls_and_results_renders(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 22}'},
    ]
    chat = ctx.format_chat(messages, template=template, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in chat.prompt
    assert chat.prompt.count("<tool_response>") == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        {"tools": [WEATHER, WEATHER]},
        {"tools": [WEATHER], "tool_choice": "sometimes"},
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ],
)
def test_bad_tools_are_value_errors(
    tool_ctx: tuple[lloyal.Context, str | None], bad: dict[str, Any]
) -> None:
    ctx, template = tool_ctx
    with pytest.raises(ValueError, match=r"tool|json_schema"):
        ctx.format_chat(ASK, template=template, **bad)


@pytest.mark.asyncio
async def test_required_tool_choice_forces_a_valid_call(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    chat = ctx.format_chat(ASK, template=template, tools=[WEATHER, CLOCK], tool_choice="required")
    grammar = chat.create_grammar(ctx)
    assert grammar is not None
    assert grammar.triggered is None
    async with lloyal.Branch.create(ctx, lloyal.SamplingParams(seed=3), grammar) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        text = await _run(b, ctx)
    out = chat.parse(text)
    assert len(out.tool_calls) >= 1, text
    for call in out.tool_calls:
        _check_call(call)


@pytest.mark.asyncio
async def test_lazy_grammar_waits_for_the_trigger_then_forces_a_call(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    chat = ctx.format_chat(ASK, template=template, tools=[WEATHER], parallel_tool_calls=False)
    async with lloyal.Branch.create(ctx, lloyal.SamplingParams(seed=5)) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        b.set_grammar(lark=chat.grammar, triggers=chat.grammar_triggers)
        assert b.grammar_triggered is False
        # Free prose first: the grammar lets anything through.
        for token in ctx.tokenize_sync("Let me check. ", add_special=False):
            await b.commit(token)
        assert b.grammar_triggered is False
        # The model starts a call (forced here: a 135M model rarely would).
        for token in ctx.tokenize_sync("<tool_call>\n", add_special=False, parse_special=False):
            await b.commit(token)
        assert b.grammar_triggered is True
        text = "Let me check. <tool_call>\n" + await _run(b, ctx)
    out = chat.parse(text)
    assert len(out.tool_calls) == 1, text
    assert out.tool_calls[0].name == "get_weather"
    _check_call(out.tool_calls[0])
    assert out.content == "Let me check."


@pytest.mark.asyncio
async def test_lazy_grammar_refuses_a_trigger_followed_by_garbage(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_seq_max=2) as ctx:
        chat = ctx.format_chat(ASK, tools=[WEATHER])
        g = chat.create_grammar(ctx)
        assert g is not None
        for token in ctx.tokenize_sync("<tool_call>", add_special=False, parse_special=False):
            assert g.allows(token)
            g.accept(token)
        assert g.triggered
        bad = ctx.tokenize_sync("oops", add_special=False)[0]
        assert not g.allows(bad)
        with pytest.raises(lloyal.GrammarError):
            g.accept(bad)
        assert g.triggered  # unchanged
        g.reset()
        assert g.triggered is False


@pytest.mark.asyncio
async def test_a_fork_that_fires_the_trigger_leaves_its_parent_waiting(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_seq_max=2) as ctx:
        chat = ctx.format_chat(ASK, tools=[WEATHER])
        async with lloyal.Branch.create(ctx, lloyal.GREEDY) as b:
            await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
            b.set_grammar(lark=chat.grammar, triggers=chat.grammar_triggers)
            trigger = ctx.tokenize_sync("<tool_call>", add_special=False, parse_special=False)
            for token in trigger[:-1]:
                await b.commit(token)
            async with await b.fork() as child:
                await child.commit(trigger[-1])
                assert child.grammar_triggered is True
                assert b.grammar_triggered is False  # forks clone the grammar
            assert b.grammar_triggered is False


def test_grammars_of_every_family_compile(smollm2: Path) -> None:
    from lloyal.chat._families import tool_grammar
    from lloyal.chat.format import _functions

    ctx = open_sync(smollm2, n_ctx=256)
    try:
        fns = _functions([WEATHER, CLOCK])
        for family in ("hermes", "llama3", "mistral", "deepseek"):
            for parallel in (True, False):
                lark, triggers = tool_grammar(family, fns, parallel)
                assert triggers
                ctx.create_grammar(lark=lark, triggers=list(triggers))
    finally:
        ctx.close()


@pytest.mark.asyncio
async def test_json_schema_reply(tool_ctx: tuple[lloyal.Context, str | None]) -> None:
    ctx, template = tool_ctx
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 12}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    chat = ctx.format_chat(ASK, template=template, json_schema=schema)
    assert chat.grammar_triggers == ()
    async with lloyal.Branch.create(ctx, lloyal.GREEDY, chat.create_grammar(ctx)) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        text = await _run(b, ctx, 40)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.asyncio
async def test_a_session_round_trip_with_a_tool(smollm2: Path) -> None:
    params = lloyal.SamplingParams(seed=1)
    async with (
        await lloyal.create_context(smollm2, n_seq_max=2) as ctx,
        await lloyal.Session.create(
            ctx, params=params, tools=[WEATHER], tool_choice="required"
        ) as s,
    ):
        await s.add_user("What is the weather in Paris?")
        reply = await s.reply(max_tokens=80)
        assert len(reply.tool_calls) >= 1
        _check_call(reply.tool_calls[0])
        assert s.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
        await s.add_tool_result('{"temp": 21}', tool_call_id="call_1")
        assert s.text == s.render().prompt
        assert "<tool_response>" in s.text


@pytest.mark.asyncio
async def test_a_token_with_text_before_the_trigger_fires_it(smollm2: Path) -> None:
    """A token " Paris" fires the trigger "Paris" (the space is free text): it
    once panicked the engine in a plain commit loop."""
    async with (
        await lloyal.create_context(smollm2, n_seq_max=2) as ctx,
        lloyal.Branch.create(ctx, lloyal.GREEDY) as b,
    ):
        await b.prefill(ctx.tokenize_sync("The capital of France is"))
        b.set_grammar(lark='start: "Paris" /[a-z ]+/ "."', triggers=["Paris"])
        (paris,) = ctx.tokenize_sync(" Paris", add_special=False)
        await b.commit(paris)
        assert b.grammar_triggered is True
        (comma,) = ctx.tokenize_sync(",", add_special=False)
        with pytest.raises(lloyal.GrammarError):
            await b.commit(comma)
        assert b.grammar_triggered is True


ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 30}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.asyncio
async def test_tools_and_a_reply_format_give_a_call_or_a_formatted_answer(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    chat = ctx.format_chat(ASK, template=template, tools=[WEATHER], json_schema=ANSWER)
    assert chat.grammar_triggers == (), "from the first token"
    # Both ways in are open, and nothing else.
    for text, allowed in (
        ('<tool_call>\n{"name": "get_weather"', True),
        ('{"answer": "Sunny"}', True),
        ("Sunny, I think.", False),
    ):
        grammar = chat.create_grammar(ctx)
        assert grammar is not None
        tokens = ctx.tokenize_sync(text, add_special=False, parse_special=False)
        ok = True
        for t in tokens:
            if not grammar.allows(t):
                ok = False
                break
            grammar.accept(t)
        assert ok is allowed, text
    # A greedy reply under it is one or the other, well formed.
    async with lloyal.Branch.create(ctx, lloyal.GREEDY, chat.create_grammar(ctx)) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        text = await _run(b, ctx)
    out = chat.parse(text)
    if out.tool_calls:
        _check_call(out.tool_calls[0])
    else:
        jsonschema.validate(json.loads(out.content), ANSWER)


NESTED = {
    "type": "function",
    "function": {
        "name": "ship",
        "parameters": {
            # As pydantic writes nested models.
            "$defs": {
                "Address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Address"}},
            "required": ["to"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.asyncio
async def test_tool_parameters_with_defs_and_refs_are_inlined(
    tool_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = tool_ctx
    chat = ctx.format_chat(ASK, template=template, tools=[NESTED], tool_choice="required")
    async with lloyal.Branch.create(
        ctx, lloyal.SamplingParams(seed=3), chat.create_grammar(ctx)
    ) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        text = await _run(b, ctx)
    (call,) = chat.parse(text).tool_calls[:1]
    jsonschema.validate(call.parsed_arguments(), NESTED["function"]["parameters"])
    broken = {"name": "f", "parameters": {"properties": {"a": {"$ref": "#/$defs/Gone"}}}}
    with pytest.raises(ValueError, match="points at nothing"):
        ctx.format_chat(ASK, template=template, tools=[broken])
