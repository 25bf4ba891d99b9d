"""Parsing replies into content, reasoning and tool calls (no model needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lloyal.chat import _families, output
from lloyal.chat.output import CHAT_FORMATS, ChatOutput, ToolCall, parse_chat_output

# DeepSeek's markers (full-width bars, U+2581 for spaces).
DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"


@dataclass(frozen=True)
class Case:
    id: str
    format: str
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reasoning: str = ""
    thinking_started: bool = False
    auto: bool = True  # "auto" must give the same result
    ids: tuple[str | None, ...] | None = None


def _ds_r1(name: str, args: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CALL_END}"


# Well-formed replies: parsed whole, and prefix by prefix while streaming.
WELL_FORMED = [
    # hermes (Hermes 2 Pro, Qwen 2.5/3)
    Case(
        "hermes-one",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    Case(
        "hermes-parallel",
        "hermes",
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
        "</tool_call>",
        "Let me check both.",
        [
            ("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("get_time", {"tz": "Europe/Paris"}),
        ],
    ),
    Case(
        "hermes-reasoning",
        "hermes",
        "<think>\nThe user wants the weather.\nI should call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō \\"東京\\""}}\n'
        "</tool_call>",
        "",
        [("get_weather", {"city": 'Tōkyō "東京"'})],
        reasoning="The user wants the weather.\nI should call the tool.",
    ),
    Case(
        "hermes-arguments-first",
        "hermes",
        '<tool_call>{"arguments": {"n": [1, 2.5e3, -3], "ok": true, "x": null}, '
        '"name": "stats"}</tool_call> Done.',
        "Done.",
        [("stats", {"n": [1, 2.5e3, -3], "ok": True, "x": None})],
    ),
    Case(
        "hermes-no-arguments",
        "hermes",
        'Sure. <tool_call>{"name": "now"}</tool_call>',
        "Sure.",
        [("now", {})],
    ),
    Case(
        "hermes-plain-text",
        "hermes",
        "If a < b and c <= d, then [x] holds; see {braces} and `code`.",
        "If a < b and c <= d, then [x] holds; see {braces} and `code`.",
    ),
    Case(
        "think-started",
        "hermes",
        "\nthe prompt opened the block\n</think>\n\nThe answer is 4.",
        "The answer is 4.",
        reasoning="the prompt opened the block",
        thinking_started=True,
    ),
    Case(
        "think-content",
        "content",
        "<think>\nhmm\n</think>\n\nHello <tool_call>",
        "Hello <tool_call>",
        reasoning="hmm",
        auto=False,
    ),
    # llama3 (Llama 3.1/3.2/3.3)
    Case(
        "llama3-bare",
        "llama3",
        '{"name": "get_weather", "parameters": {"location": "San Francisco, CA"}}',
        "",
        [("get_weather", {"location": "San Francisco, CA"})],
    ),
    Case(
        "llama3-typed",
        "llama3",
        '{"type": "function", "name": "search", "parameters": {"q": "llamas", "k": 3}}',
        "",
        [("search", {"q": "llamas", "k": 3})],
    ),
    Case(
        "llama3-bare-newlines",
        "llama3",
        '{"name": "a", "arguments": {"x": 1}}\n{"name": "b", "arguments": {"y": "2"}}',
        "",
        [("a", {"x": 1}), ("b", {"y": "2"})],
    ),
    Case(
        "llama3-python-tag",
        "llama3",
        'Calling.<|python_tag|>{"name": "a", "parameters": {}}; '
        '{"name": "b", "parameters": {"q": "x;y"}}',
        "Calling.",
        [("a", {}), ("b", {"q": "x;y"})],
    ),
    Case(
        "llama3-builtin",
        "llama3",
        '<|python_tag|>brave_search.call(query="weather in Menlo Park")',
        "",
        [("brave_search", {"query": "weather in Menlo Park"})],
    ),
    Case(
        "llama3-builtins-two",
        "llama3",
        "<|python_tag|>wolfram_alpha.call(query='2+2')\nbrave_search.call(query=\"(a) b\")",
        "",
        [("wolfram_alpha", {"query": "2+2"}), ("brave_search", {"query": "(a) b"})],
    ),
    # mistral
    Case(
        "mistral-v03",
        "mistral",
        'I will look it up.[TOOL_CALLS][{"name": "get_weather", "arguments": '
        '{"city": "Paris"}, "id": "abc123def"}, {"name": "get_time", "arguments": {}, '
        '"id": "xyz987uvw"}]',
        "I will look it up.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ids=("abc123def", "xyz987uvw"),
    ),
    Case(
        "mistral-args",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    Case(
        "mistral-repeated",
        "mistral",
        'Two calls.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "CET"}',
        "Two calls.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
        ids=(None, "a1b2c3d4e"),
    ),
    # deepseek (R1/V3, V3.1)
    Case(
        "deepseek-r1",
        "deepseek",
        "Checking."
        + DS_CALLS
        + _ds_r1("get_weather", '{"city": "Paris"}')
        + "\n"
        + _ds_r1("get_time", '{"tz": "CET"}')
        + DS_CALLS_END,
        "Checking.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    Case(
        "deepseek-reasoning",
        "deepseek",
        "<think>\nNeed weather.\n</think>\n\n"
        + DS_CALLS
        + _ds_r1("get_weather", '{"city": "Oslo"}')
        + DS_CALLS_END,
        "",
        [("get_weather", {"city": "Oslo"})],
        reasoning="Need weather.",
    ),
    Case(
        "deepseek-v31",
        "deepseek",
        DS_CALLS
        + DS_CALL
        + "get_weather"
        + DS_SEP
        + '{"city": "Paris"}'
        + DS_CALL_END
        + DS_CALL
        + "get_time"
        + DS_SEP
        + "{}"
        + DS_CALL_END
        + DS_CALLS_END,
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    # gemma
    Case(
        "gemma-tool-code",
        "gemma",
        'I will check.\n```tool_code\nget_weather(city="Paris", days=3, metric=True)\n```',
        "I will check.",
        [("get_weather", {"city": "Paris", "days": 3, "metric": True})],
    ),
    Case(
        "gemma-print-two",
        "gemma",
        "```tool_code\nprint(default_api.search(q='a (b)', tags=['x', \"y\"], n=-2))\n"
        "lookup(key={'a': 1.5, 'b': None})\n```\nThat is all.",
        "That is all.",
        [
            ("search", {"q": "a (b)", "tags": ["x", "y"], "n": -2}),
            ("lookup", {"key": {"a": 1.5, "b": None}}),
        ],
    ),
    Case(
        "gemma-json",
        "gemma",
        'Here:\n```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
        "Here:",
        [("get_weather", {"city": "Paris"})],
        auto=False,
    ),
    Case(
        "gemma-hermes",
        "gemma",
        '<tool_call>\n{"name": "f", "arguments": {"a": "```"}}\n</tool_call>',
        "",
        [("f", {"a": "```"})],
    ),
    # generic (llama.cpp-style JSON replies)
    Case(
        "generic-call",
        "generic",
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    Case(
        "generic-calls",
        "generic",
        '{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, '
        '{"name": "b", "arguments": {"y": [true]}, "id": "7"}]}',
        "",
        [("a", {"x": 1}), ("b", {"y": [True]})],
        ids=(None, "7"),
    ),
    Case(
        "generic-response",
        "generic",
        '{"response": "Hello!\\nThe answer is \\"42\\" \\ud83d\\ude00 \\u00e9."}',
        'Hello!\nThe answer is "42" \U0001f600 é.',
    ),
]

# Garbage and broken calls: the text stays content, nothing raises.
BROKEN = [
    Case(
        "hermes-bad-json",
        "hermes",
        "<tool_call>{not json}</tool_call>",
        "<tool_call>{not json}</tool_call>",
    ),
    Case(
        "hermes-unclosed",
        "hermes",
        'Hi <tool_call>{"name": "f", "arguments": {"a": "',
        'Hi <tool_call>{"name": "f", "arguments": {"a": "',
    ),
    Case(
        "hermes-no-name",
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
    ),
    Case(
        "hermes-bad-then-good",
        "hermes",
        '<tool_call>oops</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        "<tool_call>oops</tool_call>",
        [("g", {})],
    ),
    Case("mistral-junk", "mistral", "[TOOL_CALLS]oops!", "[TOOL_CALLS]oops!"),
    Case(
        "mistral-cut-off",
        "mistral",
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
        '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
    ),
    Case(
        "auto-json-not-call", "auto", '{"name": "Alice", "age": 3}', '{"name": "Alice", "age": 3}'
    ),
    Case("llama3-json-not-call", "llama3", '{"a": 1} text', '{"a": 1} text'),
    Case(
        "gemma-positional",
        "gemma",
        "```tool_code\nos.system('rm -rf /')\n```",
        "```tool_code\nos.system('rm -rf /')\n```",
    ),
    Case(
        "gemma-not-literal",
        "gemma",
        '```tool_code\nf(x=__import__("os").getcwd())\n```',
        '```tool_code\nf(x=__import__("os").getcwd())\n```',
    ),
    Case(
        "gemma-json-not-call",
        "gemma",
        '```json\n{"name": "Alice", "age": 3}\n```',
        '```json\n{"name": "Alice", "age": 3}\n```',
    ),
    Case("generic-bad-response", "generic", '{"response": 5}', '{"response": 5}'),
    Case("deepseek-begin-only", "deepseek", "Hm " + DS_CALLS, "Hm " + DS_CALLS),
    Case(
        "deepseek-bad-json",
        "deepseek",
        DS_CALLS + _ds_r1("f", "{oops}") + DS_CALLS_END,
        DS_CALLS + _ds_r1("f", "{oops}") + DS_CALLS_END,
    ),
    Case("think-unclosed", "auto", "<think>\nstill thinking", "", reasoning="still thinking"),
    Case("python-tag-code", "llama3", "<|python_tag|>print(1 + 1)", "<|python_tag|>print(1 + 1)"),
    Case("nested-garbage", "auto", "[" * 500 + "{" * 500, "[" * 500 + "{" * 500),
]


def _parse(case: Case, fmt: str, text: str, partial: bool) -> ChatOutput:
    return parse_chat_output(
        text, format=fmt, partial=partial, thinking_started=case.thinking_started
    )


def _formats(case: Case) -> list[str]:
    return [case.format, "auto"] if case.auto and case.format != "auto" else [case.format]


def _check_final(case: Case, out: ChatOutput) -> None:
    assert out.content == case.content
    assert out.reasoning == case.reasoning
    assert [(c.name, c.parsed_arguments()) for c in out.tool_calls] == case.calls
    if case.ids is not None:
        assert tuple(c.id for c in out.tool_calls) == case.ids


@pytest.mark.parametrize("case", WELL_FORMED + BROKEN, ids=lambda c: c.id)
def test_final(case: Case) -> None:
    for fmt in _formats(case):
        _check_final(case, _parse(case, fmt, case.text, partial=False))


@pytest.mark.parametrize("case", WELL_FORMED, ids=lambda c: c.id)
def test_arguments_are_the_text_written(case: Case) -> None:
    out = _parse(case, case.format, case.text, partial=False)
    for call in out.tool_calls:
        # JSON-in-text formats keep the model's own text; Python calls are serialised.
        assert call.arguments in case.text or call.arguments == json.dumps(
            call.parsed_arguments(), ensure_ascii=False
        )


@pytest.mark.parametrize("case", WELL_FORMED, ids=lambda c: c.id)
def test_streaming_is_monotone(case: Case) -> None:
    for fmt in _formats(case):
        final = _parse(case, fmt, case.text, partial=False)
        previous = ChatOutput("")
        for k in range(len(case.text) + 1):
            part = _parse(case, fmt, case.text[:k], partial=True)
            where = f"{fmt} at {k}: {case.text[:k]!r} -> {part}"
            assert final.content.startswith(part.content), where
            assert final.reasoning.startswith(part.reasoning), where
            assert len(part.tool_calls) <= len(final.tool_calls), where
            for got, last in zip(part.tool_calls, final.tool_calls, strict=False):
                assert got.name == last.name, where
                assert last.arguments.startswith(got.arguments), where
            # ...and each step only adds to the one before.
            assert part.content.startswith(previous.content), where
            assert part.reasoning.startswith(previous.reasoning), where
            assert len(part.tool_calls) >= len(previous.tool_calls), where
            for got, before in zip(part.tool_calls, previous.tool_calls, strict=False):
                assert got.arguments.startswith(before.arguments), where
            previous = part
        whole = _parse(case, fmt, case.text, partial=True)
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [
            (c.name, c.arguments) for c in final.tool_calls
        ]


@pytest.mark.parametrize(
    ("text", "fmt", "content"),
    [
        ("Hello <tool_", "hermes", "Hello"),
        ("Hello [TOOL_", "mistral", "Hello"),
        ("Hello " + DS_CALLS[:3], "deepseek", "Hello"),
        ("Hello ``", "gemma", "Hello"),
        ("<thi", "auto", ""),
        ('{"na', "auto", ""),
        # No calls: the text as written, trailing blanks at once.
        ("Hello   ", "content", "Hello   "),
        ("Hello   ", "hermes", "Hello"),
        ("Hello <b", "auto", "Hello <b"),
    ],
)
def test_streaming_holds_back_possible_markers(text: str, fmt: str, content: str) -> None:
    assert parse_chat_output(text, format=fmt, partial=True).content == content


def test_streaming_call_shows_once_named() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert parse_chat_output(text[:30], partial=True).tool_calls == ()
    (call,) = parse_chat_output(text, partial=True).tool_calls
    assert call == ToolCall("get_weather", '{"city": "Pa')
    assert call.parsed_arguments() is None


def test_parsed_arguments() -> None:
    assert ToolCall("f", '{"a": [1, {"b": null}]}').parsed_arguments() == {"a": [1, {"b": None}]}
    assert ToolCall("f", '"{\\"a\\": 1}"').parsed_arguments() == {"a": 1}  # encoded twice
    for bad in ("", "{", "[1]", "nope", "1" * 5000, "[" * 100_000):
        assert ToolCall("f", bad).parsed_arguments() is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown chat format"):
        parse_chat_output("x", format="chatml")
    with pytest.raises(TypeError):
        parse_chat_output(b"x")  # type: ignore[arg-type]
    assert set(CHAT_FORMATS) == {
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
    }


# --- random text -----------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ": ",
    ", ",
    '"f"',
    '"',
    "\\",
    "\\u",
    "\\ud83d",
    "1",
    "-",
    "true",
    "nul",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<think>",
    "</think>",
    "```tool_code",
    "```json",
    "```",
    "\n",
    " ",
    ";",
    "(",
    ")",
    "=",
    "'",
    "f(a=1)",
    "print(",
    "<|python_tag|>",
    ".call(",
    '{"tool_call":',
    '{"tool_calls": [',
    '{"response": "',
    DS_CALLS,
    DS_CALL,
    DS_SEP,
    DS_CALL_END,
    DS_CALLS_END,
    "function",
    "get_weather",
    # The tagged families (chat/_tagged.py).
    "<function=",
    "<parameter=",
    "</parameter>",
    "</function>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.f:0",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    "<|tool_call|>",
    "<|START_ACTION|>",
    "<|END_ACTION|>",
    '{"tool_name": "f", "parameters": ',
    "<|START_THINKING|>",
    "<|END_THINKING|>",
    "<|START_RESPONSE|>",
    "<|channel|>analysis<|message|>",
    "<|channel|>final",
    "to=functions.",
    "<|message|>",
    "<|call|>",
    "<|end|>",
    "é",
    "\U0001f600",
]

texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30).map(
    "".join
)


@settings(max_examples=300, deadline=None)
@given(text=texts, thinking_started=st.booleans())
def test_random_text_never_raises(text: str, thinking_started: bool) -> None:
    for fmt in CHAT_FORMATS:
        for partial in (False, True):
            # The parser proper, without parse_chat_output's last-resort guard.
            out = output._parse(
                text,
                _families.FAMILIES[fmt].parser,
                partial=partial,
                thinking_started=thinking_started,
            )
            assert out == parse_chat_output(
                text, format=fmt, partial=partial, thinking_started=thinking_started
            )
            assert isinstance(out, ChatOutput)
            assert isinstance(out.content, str)
            assert isinstance(out.reasoning, str)
            assert isinstance(out.tool_calls, tuple)
            for call in out.tool_calls:
                assert isinstance(call, ToolCall)
                assert isinstance(call.name, str)
                assert call.name
                assert isinstance(call.arguments, str)
                assert call.id is None or isinstance(call.id, str)
                args = call.parsed_arguments()
                assert args is None or isinstance(args, dict)


# --- random well-formed calls, streamed ------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)


def _render(fmt: str, calls: list[tuple[str, str]], content: str) -> str:
    if fmt == "hermes":
        blocks = "".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>\n' for n, a in calls
        )
        return f"{content}\n{blocks}"
    if fmt == "mistral":
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
    if fmt == "deepseek":
        return content + DS_CALLS + "".join(_ds_r1(n, a) for n, a in calls) + DS_CALLS_END
    if fmt == "kimi-k2":
        blocks = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"{content}<|tool_calls_section_begin|>{blocks}<|tool_calls_section_end|>"
    if fmt == "command-r":
        items = ", ".join(
            f'{{"tool_call_id": "{i}", "tool_name": "{n}", "parameters": {a}}}'
            for i, (n, a) in enumerate(calls)
        )
        return f"<|START_RESPONSE|>{content}<|END_RESPONSE|><|START_ACTION|>[{items}]<|END_ACTION|>"
    if fmt == "gpt-oss":
        return f"<|channel|>final<|message|>{content}<|end|>" + "".join(
            f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
            f"<|message|>{a}<|call|>"
            for n, a in calls
        )
    items = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
    if fmt == "granite":
        return f"{content}<|tool_call|>[{items}]"
    return f'{{"tool_calls": [{items}]}}'  # generic


@settings(max_examples=80, deadline=None)
@given(
    fmt=st.sampled_from(
        ["hermes", "mistral", "deepseek", "generic", "kimi-k2", "granite", "command-r", "gpt-oss"]
    ),
    calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=2),
    content=st.text(st.characters(codec="utf-8", exclude_characters="<[`{"), max_size=8),
    ensure_ascii=st.booleans(),
)
def test_random_calls_stream_monotone(
    fmt: str, calls: list[tuple[str, dict[str, Any]]], content: str, ensure_ascii: bool
) -> None:
    written = [(n, json.dumps(a, ensure_ascii=ensure_ascii)) for n, a in calls]
    text = _render(fmt, written, content)
    final = parse_chat_output(text, format=fmt)
    assert [(c.name, c.arguments) for c in final.tool_calls] == written
    assert [c.parsed_arguments() for c in final.tool_calls] == [a for _, a in calls]
    assert final.content == ("" if fmt == "generic" else content.strip())
    for k in range(len(text) + 1):
        part = parse_chat_output(text[:k], format=fmt, partial=True)
        assert final.content.startswith(part.content)
        for got, last in zip(part.tool_calls, final.tool_calls, strict=False):
            assert got.name == last.name
            assert last.arguments.startswith(got.arguments)
