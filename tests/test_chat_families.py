"""The tool-call families of today's models (Qwen3, Qwen3-Coder, GLM-4.5,
Kimi-K2, Granite, Command-R, GPT-OSS), each with a template written here
(``lloyal.fixtures.TOOL_TEMPLATES``): the template renders the tools and is
recognised, its grammar forces a call on SmolLM2, and the reply streamed
through the parser one character at a time gives what the whole-text parse
gives. Hand-written replies cover reasoning, content and several calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import lloyal
import pytest
from lloyal import fixtures
from lloyal.models import model_path

from tests.conftest import open_sync
from tests.test_chat_tools import ASK, CLOCK, WEATHER

FORMATS = {
    "qwen3": "hermes",
    "qwen3-coder": "qwen3-coder",
    "glm-4.5": "glm-4.5",
    "kimi-k2": "kimi-k2",
    "granite": "granite",
    "command-r": "command-r",
    "gpt-oss": "gpt-oss",
}
TOOLS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def ctx() -> Iterator[lloyal.Context]:
    c = open_sync(model_path("smollm2"), n_ctx=4096, n_seq_max=2)
    yield c
    c.close()


def streamed(text: str, fmt: str, *, well_formed: bool = True) -> lloyal.ChatOutput:
    """``text`` fed one character at a time; each partial parse is checked
    to only grow (as promised for a reply that ends well formed), and the
    stream's end against the whole-text parse."""
    whole = lloyal.parse_chat_output(text, format=fmt)
    stream = lloyal.ChatOutputStream(fmt)
    before = lloyal.ChatOutput("")
    for ch in text:
        now = stream.feed(ch)
        if not well_formed:
            continue
        assert whole.content.startswith(now.content), (now, whole)
        assert whole.reasoning.startswith(now.reasoning), (now, whole)
        assert len(now.tool_calls) >= len(before.tool_calls)
        for was, call in zip(before.tool_calls, now.tool_calls, strict=False):
            assert call.name == was.name
            assert call.arguments.startswith(was.arguments), (was, call)
        before = now
    assert stream.finish() == whole
    return whole


def check_call(call: lloyal.ToolCall) -> None:
    args = call.parsed_arguments()
    assert args is not None, call
    jsonschema.validate(args, TOOLS[call.name]["function"]["parameters"])


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.asyncio
async def test_the_grammar_forces_a_call_that_streams_as_it_parses(
    ctx: lloyal.Context, name: str
) -> None:
    template = fixtures.TOOL_TEMPLATES[name]
    chat = ctx.format_chat(ASK, template=template, tools=[WEATHER, CLOCK], tool_choice="required")
    assert chat.chat_format == FORMATS[name]
    assert "get_weather" in chat.prompt, "the template renders the tools"
    grammar = chat.create_grammar(ctx)
    assert grammar is not None
    params = lloyal.SamplingParams(seed=29, temperature=0.8)
    async with lloyal.Branch.create(ctx, params, grammar) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        stream = lloyal.TextStream(ctx)
        pieces = []
        for _ in range(160):
            p = await b.produce()
            if p.is_stop:
                break
            await b.commit(p.token)
            pieces.append(stream.push(p.token))
        text = "".join(pieces) + stream.flush()
    out = chat.parse(text)
    assert out.tool_calls, text
    for call in out.tool_calls:
        check_call(call)
    assert streamed(text, chat.chat_format).tool_calls == out.tool_calls


def test_each_template_is_recognised_from_a_gguf_that_holds_it() -> None:
    for name, fmt in FORMATS.items():
        c = open_sync(fixtures.chat_model(name), n_ctx=512)
        try:
            assert c.chat_template == fixtures.TOOL_TEMPLATES[name]
            assert c.format_chat(ASK, tools=[WEATHER]).chat_format == fmt
        finally:
            c.close()


def _calls(out: lloyal.ChatOutput) -> list[tuple[str, dict[str, Any] | None, str | None]]:
    return [(c.name, c.parsed_arguments(), c.id) for c in out.tool_calls]


REPLIES: list[tuple[str, str, str, str, list[tuple[str, dict[str, Any] | None, str | None]]]] = [
    (
        "qwen3-coder",
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n"
        '</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=tags>\n["a"]\n'
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "</function>\n</tool_call>",
        "Let me check.",
        "",
        [
            ("get_weather", {"city": "San Jose", "days": 3, "tags": ["a"]}, None),
            ("get_time", {}, None),
        ],
    ),
    (
        "glm-4.5",
        "<think>Weather first.</think>Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n"
        "</tool_call><tool_call>get_time\n</tool_call>",
        "Checking.",
        "Weather first.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}, None), ("get_time", {}, None)],
    ),
    (
        "kimi-k2",
        "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        "Sure.",
        "",
        [
            ("get_weather", {"city": "Paris"}, "functions.get_weather:0"),
            ("get_time", {}, "functions.get_time:1"),
        ],
    ),
    (
        "granite",
        'One moment. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "One moment.",
        "",
        [("get_weather", {"city": "Paris"}, None), ("get_time", {}, None)],
    ),
    (
        "command-r",
        "<|START_THINKING|>I should look it up.<|END_THINKING|><|START_ACTION|>["
        '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}]'
        "<|END_ACTION|>",
        "",
        "I should look it up.",
        [("get_weather", {"city": "Paris"}, "0")],
    ),
    (
        "command-r",
        "<|START_THINKING|>Easy.<|END_THINKING|><|START_RESPONSE|>It is sunny.<|END_RESPONSE|>",
        "It is sunny.",
        "Easy.",
        [],
    ),
    (
        "gpt-oss",
        "<|channel|>analysis<|message|>User wants the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>',
        "",
        "User wants the weather.",
        [("get_weather", {"city": "Paris"}, None)],
    ),
    (
        "gpt-oss",
        "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello!<|return|>",
        "Hello!",
        "Greet back.",
        [],
    ),
]


@pytest.mark.parametrize(
    ("fmt", "text", "content", "reasoning", "calls"),
    REPLIES,
    ids=[f"{r[0]}-{i}" for i, r in enumerate(REPLIES)],
)
def test_replies_of_each_family_parse_whole_and_streamed(
    fmt: str, text: str, content: str, reasoning: str, calls: list[Any]
) -> None:
    for f in (fmt, "auto") if fmt in ("qwen3-coder", "glm-4.5", "kimi-k2", "granite") else (fmt,):
        out = streamed(text, f)
        assert _calls(out) == calls, f
        if f == fmt:
            assert (out.content, out.reasoning) == (content, reasoning)


def test_broken_tagged_calls_stay_content() -> None:
    for fmt, text in [
        ("qwen3-coder", "<tool_call>\n<function=get weather>\n</function>\n</tool_call>"),
        ("glm-4.5", "<tool_call>get_weather\n<arg_key>city<arg_value>Paris</tool_call>"),
        ("kimi-k2", "<|tool_calls_section_begin|><|tool_call_begin|>get<|tool_call_end|>"),
        ("command-r", '<|START_ACTION|>[{"tool_name": 3}]<|END_ACTION|>'),
        ("gpt-oss", "to=functions.get_weather <|message|>not json<|call|>"),
    ]:
        out = streamed(text, fmt, well_formed=False)
        assert out.tool_calls == (), (fmt, out)
        assert out.content, fmt


def test_tagged_values_become_json() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\nsome text\n</parameter>\n"
        '<parameter=q>\n"quoted"\n</parameter>\n<parameter=n>\n-1.5\n</parameter>\n'
        '<parameter=b>\ntrue\n</parameter>\n<parameter=o>\n{"k": null}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    (call,) = lloyal.parse_chat_output(text, format="qwen3-coder").tool_calls
    assert json.loads(call.arguments) == {
        "s": "some text",
        "q": '"quoted"',
        "n": -1.5,
        "b": True,
        "o": {"k": None},
    }


THINKING_TEMPLATE = fixtures.TOOL_TEMPLATES["qwen3"].replace(
    "<|im_start|>assistant\n{% if enable_thinking",
    "<|im_start|>assistant\n<think>\n{% if enable_thinking",
)


@pytest.mark.parametrize("budget", [0, 5])
@pytest.mark.asyncio
async def test_a_reasoning_budget_closes_the_thinking_then_the_model_goes_on(
    ctx: lloyal.Context, budget: int
) -> None:
    chat = ctx.format_chat(ASK, template=THINKING_TEMPLATE)
    assert chat.thinking_started
    limit = chat.reasoning_budget(ctx, budget)
    async with lloyal.Branch.create(ctx, lloyal.GREEDY) as b:
        await b.prefill(await ctx.tokenize(chat.prompt, add_special=False))
        stream = lloyal.TextStream(ctx)
        text = ""
        after = 0  # tokens the model chose after the closer
        for _ in range(40):
            p = await b.produce()
            token = limit.choose(p.token)
            if "</think>" in text:
                assert token == p.token, "after the closer, the model decides"
                after += 1
            if token == p.token and p.is_stop:
                break
            await b.commit(token)
            text += stream.push(token)
    assert limit.spent == budget
    assert "</think>" in text
    out = chat.parse(text + stream.flush())
    reasoning = ctx.tokenize_sync(out.reasoning, add_special=False) if out.reasoning else []
    assert len(reasoning) <= budget + 1, out  # one token of rounding at the cut
    # The budget ends the reasoning, not the reply: the model is asked on.
    # (What it answers, or whether it stops at once, is the model's greedy
    # choice, which may differ by host.)
    assert after >= 1


@pytest.mark.asyncio
async def test_a_session_keeps_to_its_reasoning_budget(smollm2: Any) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048) as c:
        session = await lloyal.Session.create(c, params=lloyal.GREEDY, template=THINKING_TEMPLATE)
        await session.add_user("Name a colour.")
        # Unlimited, SmolLM2 reasons for 20 tokens here (greedy).
        out = await session.reply(max_tokens=24, reasoning_budget=3)
        assert out.reasoning, out
        assert len(c.tokenize_sync(out.reasoning, add_special=False)) <= 4, out


def test_a_closer_the_model_began_is_finished_not_written_again(ctx: lloyal.Context) -> None:
    limit = lloyal.ReasoningBudget(ctx, 2, thinking_started=True)
    began = ctx.tokenize_sync(" hm</", add_special=False)
    assert len(began) >= 2
    chosen = [limit.choose(t) for t in began]
    while limit.forcing:
        chosen.append(limit.choose(13))
    text = "".join(ctx.token_to_text(t) for t in chosen)
    assert text.count("</") == 1, text
    assert "</think>" in text, text


def test_tagged_values_that_are_not_json_stay_strings() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=a>\nNaN\n</parameter>\n<parameter=b>\n"
        + "[" * 3000
        + "\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = lloyal.parse_chat_output(text, format="qwen3-coder").tool_calls
    args = json.loads(call.arguments)
    assert args["a"] == "NaN"
    assert args["b"] == "[" * 3000


def test_tagged_grammars_take_const_pattern_and_empty_strings(ctx: lloyal.Context) -> None:
    from lloyal.chat._families import tool_grammar

    params = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "maxLength": 0},
            "b": {"type": "string", "minLength": 0, "maxLength": 3},
            "c": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "d": {"const": "x"},
        },
        "required": ["b", "c", "d"],
    }
    for fmt in ("qwen3-coder", "glm-4.5"):
        lark, triggers = tool_grammar(fmt, [{"name": "f", "parameters": params}], False)
        assert ctx.create_grammar(lark=lark, triggers=list(triggers)) is not None


def test_a_negative_budget_never_interferes(ctx: lloyal.Context) -> None:
    limit = lloyal.ReasoningBudget(ctx, -1, thinking_started=True)
    tokens = ctx.tokenize_sync(" a b c d e f", add_special=False)
    assert [limit.choose(t) for t in tokens] == tokens
    with pytest.raises(TypeError):
        lloyal.ReasoningBudget(ctx, 1.5)  # type: ignore[arg-type]


def test_a_marker_that_is_a_special_token_is_written_as_that_token(ctx: lloyal.Context) -> None:
    # SmolLM2's <|im_start|> stands in for a family marker that is one
    # special token (GPT-OSS's <|call|>, Kimi's section markers).
    from lloyal.chat import _families

    (special,) = ctx.tokenize_sync("<|im_start|>", add_special=False, parse_special=True)
    token = _families._SPECIALS.set({"<|im_start|>": special})
    try:
        literal = _families._lark("call<|im_start|>now")
    finally:
        _families._SPECIALS.reset(token)
    assert literal == f'"call" <[{special}]> "now"'
    grammar = ctx.create_grammar(lark=f"start: {literal}")
    assert grammar is not None
    for t in ctx.tokenize_sync("call", add_special=False):
        grammar.accept(t)
    assert grammar.allows(special)
    plain = ctx.tokenize_sync("<|im_start|>", add_special=False, parse_special=False)
    assert len(plain) > 1
    assert not grammar.allows(plain[0]), "the marker is the special token, not its text"


def test_a_lazy_grammar_whose_trigger_is_a_special_token_fires_on_that_token(
    ctx: lloyal.Context,
) -> None:
    # The grammar names the special token itself (as it does for a family
    # whose opener is one, GPT-OSS's <|start|> say): when the model emits
    # it, the grammar is fed that token, not the trigger's text tokenized.
    grammar = ctx.create_grammar(lark='start: <|im_start|> "call"', triggers=["<|im_start|>"])
    assert grammar is not None
    (special,) = ctx.tokenize_sync("<|im_start|>", add_special=False, parse_special=True)
    for t in ctx.tokenize_sync("Some text first. ", add_special=False):
        grammar.accept(t)
    assert grammar.allows(special)
    grammar.accept(special)
    (call,) = ctx.tokenize_sync("call", add_special=False)
    other = ctx.tokenize_sync(" nope", add_special=False)[0]
    assert not grammar.allows(other), "fired: the grammar constrains now"
    grammar.accept(call)
    assert grammar.is_accepting
