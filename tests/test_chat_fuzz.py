"""Chat histories of any shape against format_chat, on every built-in
template and each test model's own (issue 27): a history either renders
or is refused with a typed error naming what is wrong; nothing else
(AttributeError, KeyError, RecursionError) ever comes out. The shapes are
the server fuzzer's (tests/server_fuzz.py): valid messages, messages with
one or two fields broken, and any JSON value where a message should be."""

from __future__ import annotations

from typing import Any

import lloyal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lloyal._lloyal import builtin_chat_templates

from tests.server_fuzz import _MESSAGE, _TOOL, JSON, _broken, _whole

HISTORY = st.lists(
    _whole(_MESSAGE, ("role", "content")) | _broken(_MESSAGE, ("role", "content")),
    min_size=1,
    max_size=4,
)
TOOLS = st.none() | st.lists(_whole(_TOOL, ("type", "function")), min_size=1, max_size=2)
TEMPLATES: list[str | None] = [None, *builtin_chat_templates()]
REFUSED = (ValueError, TypeError, lloyal.ChatTemplateError)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    messages=HISTORY,
    tools=TOOLS,
    template=st.sampled_from(TEMPLATES),
    odd=st.sampled_from([None, *range(3)]),
    junk=JSON,
)
def test_any_history_renders_or_is_refused_with_a_typed_error(
    shared_ctx: lloyal.Context,
    messages: list[Any],
    tools: list[Any] | None,
    template: str | None,
    odd: int | None,
    junk: Any,
) -> None:
    if odd is not None and odd < len(messages):
        messages[odd] = junk  # any JSON value where a message should be
    try:
        chat = shared_ctx.format_chat(messages, template=template, tools=tools)
    except REFUSED as e:
        said = str(e)
    else:
        said = chat.prompt
    assert isinstance(said, str)
