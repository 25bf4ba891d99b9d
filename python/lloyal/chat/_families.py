"""Each chat format in one row: how a template that speaks it is
recognised, the markers its calls are written with, the grammar that
forces a call, and the parser that reads calls back.

Reading (``parser``) covers every format :func:`lloyal.parse_chat_output`
takes; writing (``grammar``, ``recognise``) the four families a template
can ask for tools in: hermes, llama3, mistral and deepseek.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lloyal.chat._blocks import (
    _deepseek_block,
    _hermes_block,
    _json_fence_block,
    _mistral_block,
    _python_tag_block,
    _Spec,
    _tool_code_block,
)
from lloyal.chat._markers import (
    DEEPSEEK,
    DEEPSEEK_CALL,
    DS_CALL,
    DS_CALLS,
    HERMES,
    JSON_FENCE,
    LLAMA3_HEADER,
    PYTHON_TAG,
    TOOL_CALL,
    TOOL_CALLS,
    TOOL_CODE,
)

_Functions = list[dict[str, Any]]
_Grammar = Callable[[_Functions, bool], tuple[str, tuple[str, ...]]]


@dataclass(frozen=True)
class Family:
    """One chat format.

    ``parser`` reads a reply's calls; ``markers`` are what its calls are
    written with (kept as text when they are special tokens); ``grammar``
    gives, for the allowed tools and whether several calls may follow each
    other, the Lark grammar of the calls and the words that arm it;
    ``recognise`` are the texts that show a template speaks this family
    (``needs_tools``: only in a template that mentions tools)."""

    parser: _Spec
    markers: tuple[str, ...] = ()
    grammar: _Grammar | None = None
    recognise: tuple[str, ...] = ()
    needs_tools: bool = False


# Compact JSON, as for json_schema= grammars: small models given free
# whitespace tend to emit runs of newlines.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def inline_json(schema: Mapping[str, Any] | bool) -> str:
    """``schema`` as inline ``%json`` text, compact unless it says otherwise."""
    if isinstance(schema, Mapping) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _COMPACT}
    return json.dumps(schema)


def _call_schema(functions: list[dict[str, Any]], args_key: str) -> dict[str, Any]:
    """JSON schema of one call: a name and arguments matching that tool."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _lark(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _calls(parallel: bool, sep: str) -> str:
    return f"start: call ({sep} call)*\n" if parallel else "start: call\n"


def _hermes(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    schema = inline_json(_call_schema(functions, "arguments"))
    opener, closer = (_lark(m) for m in HERMES)
    rule = f"call: {opener} WS? %json {schema} WS? {closer}\nWS: /[ \\t\\r\\n]+/\n"
    return _calls(parallel, "WS") + rule, (HERMES[0],)


def _llama3(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    schema = inline_json(_call_schema(functions, "parameters"))
    rule = f"call: %json {schema}\nSEP: /; ?|\\n/\n"
    return _calls(parallel, "SEP") + rule, ('{"name"', '{ "name"')


def _mistral(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    array: dict[str, Any] = {
        "type": "array",
        "items": _call_schema(functions, "arguments"),
        "minItems": 1,
    }
    if not parallel:
        array["maxItems"] = 1
    return f"start: {_lark(TOOL_CALLS)} %json {inline_json(array)}\n", (TOOL_CALLS,)


def _deepseek(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    names = " | ".join(
        f'{_lark(f["name"])} "\\n```json\\n" %json {inline_json(f["parameters"])} "\\n```"'
        for f in functions
    )
    return (
        f"start: {_lark(DEEPSEEK[0])} call{'+' if parallel else ''} {_lark(DEEPSEEK[1])}\n"
        f"call: {_lark(DEEPSEEK_CALL[0])} ({names}) {_lark(DEEPSEEK_CALL[1])}\n",
        (DEEPSEEK[0],),
    )


_DEEPSEEK_BLOCKS = {DS_CALLS: _deepseek_block, DS_CALL: _deepseek_block}

FAMILIES: Mapping[str, Family] = {
    "auto": Family(
        _Spec(
            {
                TOOL_CALL: _hermes_block,
                PYTHON_TAG: _python_tag_block,
                TOOL_CALLS: _mistral_block,
                **_DEEPSEEK_BLOCKS,
                TOOL_CODE: _tool_code_block,
            },
            generic=True,
            llama=True,
        )
    ),
    "content": Family(_Spec({})),
    "hermes": Family(_Spec({TOOL_CALL: _hermes_block}), HERMES, _hermes, (TOOL_CALL,)),
    "llama3": Family(
        _Spec({PYTHON_TAG: _python_tag_block}, llama=True),
        (PYTHON_TAG,),
        _llama3,
        (PYTHON_TAG, LLAMA3_HEADER),
        needs_tools=True,
    ),
    "mistral": Family(_Spec({TOOL_CALLS: _mistral_block}), (TOOL_CALLS,), _mistral, (TOOL_CALLS,)),
    "deepseek": Family(_Spec(_DEEPSEEK_BLOCKS), DEEPSEEK, _deepseek, (DEEPSEEK[0],)),
    "gemma": Family(
        _Spec(
            {TOOL_CODE: _tool_code_block, JSON_FENCE: _json_fence_block, TOOL_CALL: _hermes_block}
        )
    ),
    "generic": Family(_Spec({}, generic=True)),
}
"""Every format, by name (the values :data:`lloyal.CHAT_FORMATS` lists)."""


def family(template: str) -> str | None:
    """The tool-call family a template's source speaks (``None`` when the
    template does not mention tools; hermes when it does but names no
    family)."""
    for name, f in FAMILIES.items():
        if not f.needs_tools and any(m in template for m in f.recognise):
            return name
    if "tools" not in template:
        return None
    for name, f in FAMILIES.items():
        if f.needs_tools and any(m in template for m in f.recognise):
            return name
    return "hermes"


def tool_grammar(
    chat_format: str, functions: _Functions, parallel: bool
) -> tuple[str, tuple[str, ...]]:
    """Lark grammar for the calls of ``chat_format``, and its trigger words."""
    f = FAMILIES.get(chat_format)
    if f is None or f.grammar is None:
        raise ValueError(f"no tool-call grammar for chat format {chat_format!r}")
    return f.grammar(functions, parallel)
