"""Each chat format in one row: how a template that speaks it is
recognised, the markers its calls are written with, the grammar that
forces a call, and the parser that reads calls back.

Reading (``parser``) covers every format :func:`lloyal.parse_chat_output`
takes; writing (``grammar``, ``recognise``) the families a template can
ask for tools in: hermes, llama3, mistral, deepseek, qwen3-coder, glm-4.5,
kimi-k2, granite, command-r and gpt-oss.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from lloyal.chat._blocks import (
    _BROKEN,
    _Block,
    _deepseek_block,
    _hermes_block,
    _json_fence_block,
    _mistral_block,
    _python_tag_block,
    _Spec,
    _tool_code_block,
)
from lloyal.chat._markers import (
    ARG_KEY,
    CR_ACTION,
    CR_RESPONSE,
    CR_THINKING,
    DEEPSEEK,
    DEEPSEEK_CALL,
    DS_CALL,
    DS_CALLS,
    GRANITE_CALL,
    HARMONY_ANALYSIS,
    HARMONY_CALL,
    HARMONY_STRUCTURE,
    HERMES,
    JSON_FENCE,
    KIMI_ARGS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_SECTION,
    KIMI_SECTION_END,
    LLAMA3_HEADER,
    PYTHON_TAG,
    QWEN_FUNCTION,
    QWEN_PARAMETER,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_CALLS,
    TOOL_CODE,
)
from lloyal.chat._scan import _NAME, _Memo, _skip
from lloyal.chat._tagged import (
    _command_r_block,
    _drop_block,
    _glm_block,
    _granite_block,
    _harmony_block,
    _kimi_block,
    _qwen_coder_block,
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


# The markers that are single special tokens of the model the grammar is
# for, with their ids (see ``tool_grammar``): written as llguidance token
# references (``<[id]>``), since the token env keeps special tokens apart
# from text (a quoted literal would make the model spell the marker out of
# plain pieces).
_SPECIALS: ContextVar[Mapping[str, int] | None] = ContextVar("_SPECIALS", default=None)


def _lark(text: str) -> str:
    """``text`` as a Lark literal, its special-token markers as tokens."""
    specials = _SPECIALS.get() or {}
    found = [m for m in specials if m in text]
    if not found:
        return json.dumps(text, ensure_ascii=False)
    parts = re.split(
        "(" + "|".join(map(re.escape, sorted(found, key=len, reverse=True))) + ")", text
    )
    return " ".join(
        f"<[{specials[p]}]>" if p in specials else json.dumps(p, ensure_ascii=False)
        for p in parts
        if p
    )


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


def _params(f: dict[str, Any]) -> tuple[list[tuple[str, Any]], set[str]]:
    """A function's parameters in order, and the required ones."""
    schema = f["parameters"]
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    required = schema.get("required", []) if isinstance(schema, Mapping) else []
    return list(props.items()) if isinstance(props, Mapping) else [], set(required)


def _tag_value(schema: Any, terminal: str, terminals: list[str]) -> str:
    """The grammar of a value written between tags: an enum of strings as
    its words, a string as a line of text (``maxLength`` kept), anything
    else as JSON."""
    if isinstance(schema, Mapping):
        enum = schema.get("enum")
        if isinstance(schema.get("const"), str):
            enum = [schema["const"]]
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            return "(" + " | ".join(_lark(e) for e in enum) + ")"
        if schema.get("type") == "string":
            pattern = schema.get("pattern")
            if isinstance(pattern, str):  # written bare, as the text must match it
                body = pattern.removeprefix("^").removesuffix("$").replace("/", "\\/")
                terminals.append(f"{terminal}: /{body}/")
                return terminal
            lo = schema.get("minLength", 1)
            lo = max(0, lo) if isinstance(lo, int) else 1
            hi = schema.get("maxLength")
            if isinstance(hi, int):
                count = f"{{{min(lo, max(hi, 0))},{max(hi, 0)}}}"
            else:
                count = f"{{{lo},}}"
            terminals.append(f"{terminal}: /[^<\\n]{count}/")
            return terminal
    return f"%json {inline_json(schema)}"


def _tagged(
    functions: _Functions,
    head: Callable[[str], str],
    member: Callable[[str, str], str],
) -> tuple[str, list[str]]:
    """The alternatives ``head(name) member(key, value)...`` of each
    function (optional parameters may be left out), and the terminals."""
    alts: list[str] = []
    terminals: list[str] = []
    for fi, f in enumerate(functions):
        params, required = _params(f)
        parts = [head(f["name"])]
        for pi, (key, schema) in enumerate(params):
            part = member(key, _tag_value(schema, f"V{fi}_{pi}", terminals))
            parts.append(part if key in required else f"({part})?")
        alts.append(" ".join(parts))
    return " | ".join(f"({a})" for a in alts), terminals


def _qwen_coder(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    alts, terminals = _tagged(
        functions,
        lambda name: _lark(f"{QWEN_FUNCTION}{name}>\n"),
        lambda key, value: (
            f"{_lark(f'{QWEN_PARAMETER}{key}>' + chr(10))} {value} "
            f"{_lark(chr(10) + '</parameter>' + chr(10))}"
        ),
    )
    end = _lark("</function>" + chr(10) + TOOL_CALL_END)
    call = f"call: {_lark(TOOL_CALL + chr(10))} ({alts}) {end}"
    rules = [_calls(parallel, "WS").strip(), call, "WS: /[ \\t\\r\\n]+/", *terminals]
    return "\n".join(rules) + "\n", (TOOL_CALL,)


def _glm(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    alts, terminals = _tagged(
        functions,
        lambda name: _lark(name + chr(10)),
        lambda key, value: (
            f"{_lark(f'{ARG_KEY}{key}</arg_key>' + chr(10) + '<arg_value>')} "
            f"{value} {_lark('</arg_value>' + chr(10))}"
        ),
    )
    call = f"call: {_lark(TOOL_CALL)} ({alts}) {_lark(TOOL_CALL_END)}"
    rules = [_calls(parallel, "WS").strip(), call, "WS: /[ \\t\\r\\n]+/", *terminals]
    return "\n".join(rules) + "\n", (TOOL_CALL,)


def _kimi(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    alts = " | ".join(
        f"({_lark(f['name'] + ':')} IDX {_lark(KIMI_ARGS)} %json {inline_json(f['parameters'])})"
        for f in functions
    )
    return (
        f"start: {_lark(KIMI_SECTION)} call{'+' if parallel else ''} {_lark(KIMI_SECTION_END)}\n"
        f"call: {_lark(KIMI_CALL + 'functions.')} ({alts}) {_lark(KIMI_CALL_END)}\n"
        "IDX: /[0-9]{1,3}/\n",
        (KIMI_SECTION,),
    )


def _granite(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    return _json_list(GRANITE_CALL, "", _call_schema(functions, "arguments"), parallel)


def _command_r(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    options = [
        {
            "type": "object",
            "properties": {
                "tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"},
                "tool_name": {"const": f["name"]},
                "parameters": f["parameters"],
            },
            "required": ["tool_call_id", "tool_name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    item = options[0] if len(options) == 1 else {"anyOf": options}
    return _json_list(CR_ACTION[0], CR_ACTION[1], item, parallel)


def _json_list(
    opener: str, closer: str, item: dict[str, Any], parallel: bool
) -> tuple[str, tuple[str, ...]]:
    array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    end = f" {_lark(closer)}" if closer else ""
    return f"start: {_lark(opener)} %json {inline_json(array)}{end}\n", (opener,)


def _gpt_oss(functions: _Functions, parallel: bool) -> tuple[str, tuple[str, ...]]:
    # One call per message in harmony: ``parallel`` changes nothing.
    alts = " | ".join(
        f"({_lark(f['name'] + ' <|constrain|>json<|message|>')} "
        f"%json {inline_json(f['parameters'])})"
        for f in functions
    )
    return (
        f"start: ({_lark('<|channel|>commentary ')})? call\n"
        f"call: {_lark(HARMONY_CALL)} ({alts}) {_lark('<|call|>')}\n",
        (HARMONY_CALL,),
    )


def _any_tool_call_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``<tool_call>`` in ``auto``: hermes JSON, else Qwen3-Coder's or
    GLM-4.5's tags."""
    for block in (_hermes_block, _qwen_coder_block):
        found = block(text, i, partial, memo)
        if found.status != "broken":
            return found
    # GLM-4.5 ends its call's name with a newline: without one, the text
    # after <tool_call> is not taken for a name (hermes junk stays text).
    name = _NAME.match(text, _skip(text, i + len(TOOL_CALL)))
    if name is not None and text[name.end() : name.end() + 1] in ("", "\n"):
        return _glm_block(text, i, partial, memo)
    return _BROKEN


_DEEPSEEK_BLOCKS = {DS_CALLS: _deepseek_block, DS_CALL: _deepseek_block}
_HARMONY = {HARMONY_CALL: _harmony_block, **{m: _drop_block(m) for m in HARMONY_STRUCTURE}}

FAMILIES: Mapping[str, Family] = {
    "auto": Family(
        _Spec(
            {
                TOOL_CALL: _any_tool_call_block,
                PYTHON_TAG: _python_tag_block,
                TOOL_CALLS: _mistral_block,
                **_DEEPSEEK_BLOCKS,
                TOOL_CODE: _tool_code_block,
                KIMI_SECTION: _kimi_block,
                KIMI_CALL: _kimi_block,
                GRANITE_CALL: _granite_block,
                CR_ACTION[0]: _command_r_block,
                HARMONY_CALL: _harmony_block,
            },
            generic=True,
            llama=True,
        )
    ),
    "content": Family(_Spec({})),
    # Before hermes: their templates name <tool_call> too.
    "qwen3-coder": Family(
        _Spec({TOOL_CALL: _qwen_coder_block}),
        HERMES,
        _qwen_coder,
        (QWEN_FUNCTION, QWEN_PARAMETER),
    ),
    "glm-4.5": Family(_Spec({TOOL_CALL: _glm_block}), HERMES, _glm, (ARG_KEY,)),
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
    "kimi-k2": Family(
        _Spec({KIMI_SECTION: _kimi_block, KIMI_CALL: _kimi_block}),
        (KIMI_SECTION, KIMI_SECTION_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END),
        _kimi,
        (KIMI_SECTION,),
    ),
    "granite": Family(
        _Spec({GRANITE_CALL: _granite_block}), (GRANITE_CALL,), _granite, (GRANITE_CALL,)
    ),
    "command-r": Family(
        _Spec(
            {
                CR_ACTION[0]: _command_r_block,
                CR_RESPONSE[0]: _drop_block(CR_RESPONSE[0]),
                CR_RESPONSE[1]: _drop_block(CR_RESPONSE[1]),
            },
            think=CR_THINKING,
        ),
        (*CR_ACTION, *CR_THINKING, *CR_RESPONSE),
        _command_r,
        (CR_ACTION[0],),
    ),
    "gpt-oss": Family(
        _Spec(_HARMONY, think=HARMONY_ANALYSIS),
        (HARMONY_CALL, *HARMONY_ANALYSIS, *HARMONY_STRUCTURE),
        _gpt_oss,
        ("<|channel|>",),
    ),
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
    chat_format: str,
    functions: _Functions,
    parallel: bool,
    specials: Mapping[str, int] | None = None,
) -> tuple[str, tuple[str, ...]]:
    """Lark grammar for the calls of ``chat_format``, and its trigger words.
    ``specials``: the family's markers that are single special tokens of
    the model, with their ids (written as tokens, not text)."""
    f = FAMILIES.get(chat_format)
    if f is None or f.grammar is None:
        raise ValueError(f"no tool-call grammar for chat format {chat_format!r}")
    token = _SPECIALS.set(specials or {})
    try:
        return f.grammar(functions, parallel)
    finally:
        _SPECIALS.reset(token)
