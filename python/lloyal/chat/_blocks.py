"""What follows a marker, per family: each block parser reads the calls
after its marker (``_families`` says which markers each format knows)."""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from lloyal.chat._markers import (
    ARGS,
    CALL_ID,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    FENCE,
    JSON_FENCE,
    PYTHON_TAG,
    THINK,
    THINK_END,
    TOOL_CALL,
    TOOL_CALL_END,
    TOOL_CALLS,
    TOOL_CODE,
)
from lloyal.chat._scan import (
    _CALL_FIRST_KEYS,
    _DS_NAME,
    _GENERIC_KEYS,
    _NAME,
    _WS,
    _calls_of,
    _Memo,
    _pending,
    _scan,
    _skip,
    _Value,
)
from lloyal.chat._types import ToolCall

# --- blocks: what follows a marker ---------------------------------------------


@dataclass
class _Block:
    """How a marker's block parsed: "ok" (calls, and where the text goes on),
    "stop" (streaming: the calls so far, and hold back the rest) or
    "broken" (the marker is just text)."""

    status: Literal["ok", "stop", "broken"]
    calls: list[ToolCall] = field(default_factory=list)
    end: int = 0


_BROKEN = _Block("broken")


def _wait(partial: bool, calls: list[ToolCall], end: int = -1) -> _Block:
    """Streaming: hold back and show ``calls``; final: keep the calls made
    before ``end`` (or, if none, the marker is text)."""
    if partial:
        return _Block("stop", calls)
    return _Block("ok", calls, end) if calls and end >= 0 else _BROKEN


def _json_after(marker: str, end: str) -> _BlockParser:
    """The block of a family whose ``marker`` is followed by a call object
    or a list of them, then ``end`` (optional: ``""`` for none)."""

    def block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
        j = _skip(text, i + len(marker))
        if j == len(text):
            return _wait(partial, [])
        if text[j] not in "{[":
            return _BROKEN
        node = _scan(text, j)
        if node is None:
            return _BROKEN
        valid, calls = _calls_of(text, node, require_args=False)
        if not valid:
            return _BROKEN
        if not node.complete:
            return _wait(partial, calls)
        k = _skip(text, node.end)
        if end and text.startswith(end, k):
            return _Block("ok", calls, k + len(end))
        if partial and end and _pending(text, k, end):
            return _Block("stop", calls)
        return _Block("ok", calls, node.end)

    return block


_hermes_block = _json_after(TOOL_CALL, TOOL_CALL_END)  # also Granite's, see _tagged


def _json_calls(text: str, j: int, partial: bool, require_args: bool) -> _Block:
    """Call objects (or, without ``require_args``, arrays of them) from
    ``text[j]`` on, separated by whitespace or ``;``."""
    openers = "{" if require_args else "{["
    calls: list[ToolCall] = []
    k = j
    while True:
        node = _scan(text, k)
        if node is None:
            return _wait(False, calls, k)
        valid, found = _calls_of(text, node, require_args)
        if not valid:
            return _wait(False, calls, k)
        if not node.complete:
            return _wait(partial, calls + found, k)
        calls += found
        k2 = _skip(text, node.end, _WS + ";")
        if k2 == len(text):
            return _Block("stop", calls) if partial else _Block("ok", calls, k2)
        if text[k2] not in openers:
            return _Block("ok", calls, k2)
        k = k2


_PY_CALLEE = re.compile(r"[A-Za-z_]\w*(?:[ \t]*\.[ \t]*[A-Za-z_]\w*)*")
_PY_NAMES: Mapping[str, object] = {"true": True, "false": False, "null": None}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> object:
    """A JSON-able value from a literal expression; never evaluates code."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
    elif isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        result: dict[str, object] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            name = None if key is None else _literal(key)
            if not isinstance(name, str):
                raise _NotLiteral
            result[name] = _literal(value)
        return result
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        number = node.operand.value if isinstance(node.operand, ast.Constant) else None
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    raise _NotLiteral


def _callee(func: ast.expr) -> str | None:
    """``f`` -> f, ``api.f`` -> f, ``brave_search.call`` -> brave_search."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return _callee(func.value) if func.attr == "call" else func.attr
    return None


def _python_call(source: str) -> ToolCall | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call = ast.parse(source, mode="eval").body
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "print"
            and len(call.args) == 1
            and not call.keywords
            and isinstance(call.args[0], ast.Call)
        ):
            call = call.args[0]
        if not isinstance(call, ast.Call) or call.args:
            return None
        name = _callee(call.func)
        if name is None:
            return None
        arguments: dict[str, object] = {}
        for keyword in call.keywords:
            if keyword.arg is None or keyword.arg in arguments:
                return None
            arguments[keyword.arg] = _literal(keyword.value)
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except Exception:  # not Python, not literals, too deep, not JSON-able
        return None


def _python_calls(text: str, j: int, partial: bool, memo: _Memo) -> _Block:
    """Calls in Python syntax from ``text[j]`` on, one per line or ``;``."""
    calls: list[ToolCall] = []
    k = j
    n = len(text)
    while True:
        start = _skip(text, k, _WS + ";")
        if start == n:
            return _Block("stop", calls) if partial else _wait(False, calls, start)
        callee = _PY_CALLEE.match(text, start)
        if callee is None:
            return _wait(False, calls, start)
        p = _skip(text, callee.end())
        if p == n or (text[p] == "." and _skip(text, p + 1) == n):  # more name may follow
            return _wait(partial, calls, start)
        if text[p] != "(":
            return _wait(False, calls, start)
        close = memo.close_paren(p)
        if close == -1:
            return _wait(partial, calls, start)
        call = _python_call(text[start:close]) if close > 0 else None
        if call is None:
            return _wait(False, calls, start)
        calls.append(call)
        k = close


def _python_tag_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    j = _skip(text, i + len(PYTHON_TAG))
    if j == len(text):
        return _wait(partial, [])
    if text[j] in "{[":
        return _json_calls(text, j, partial, require_args=False)
    return _python_calls(text, j, partial, memo)


def _fence_close(text: str, block: _Block, partial: bool) -> _Block:
    """Consume the ``` that closes a fenced block of calls, if it is there."""
    if block.status != "ok":
        return block
    k = _skip(text, block.end)
    if text.startswith(FENCE, k):
        return _Block("ok", block.calls, k + len(FENCE))
    if partial and _pending(text, k, FENCE):
        return _Block("stop", block.calls)
    return block


def _tool_code_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    k = i + len(TOOL_CODE)
    if k == len(text):
        return _wait(partial, [])
    if text[k] not in _WS:
        return _BROKEN
    return _fence_close(text, _python_calls(text, k, partial, memo), partial)


def _json_fence_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    k = i + len(JSON_FENCE)
    if k == len(text):
        return _wait(partial, [])
    if text[k] not in _WS:
        return _BROKEN
    j = _skip(text, k)
    if j == len(text):
        return _wait(partial, [])
    node = _scan(text, j) if text[j] in "{[" else None
    if node is None:
        return _BROKEN
    valid, calls = _calls_of(text, node, require_args=True)
    if not valid:
        return _BROKEN
    if not node.complete:
        return _wait(partial, calls)
    return _fence_close(text, _Block("ok", calls, node.end), partial)


_mistral_json = _json_after(TOOL_CALLS, "")


def _mistral_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    n = len(text)
    k = _skip(text, i + len(TOOL_CALLS))
    if k == n:
        return _wait(partial, [])
    if text[k] in "{[":  # v0.3: a JSON array (or object) of calls
        return _mistral_json(text, i, partial, memo)
    calls: list[ToolCall] = []  # name[CALL_ID]id[ARGS]{...}, possibly repeated
    while True:
        name = _NAME.match(text, k)
        if name is None:
            return _wait(False, calls, k)
        e = name.end()
        call_id = None
        if text.startswith(CALL_ID, e):
            found = _NAME.match(text, e + len(CALL_ID))
            id_end = found.end() if found else e + len(CALL_ID)
            if partial and _pending(text, id_end, ARGS):
                return _Block("stop", calls)
            if not text.startswith(ARGS, id_end):
                return _wait(False, calls, k)
            call_id = text[e + len(CALL_ID) : id_end]
            a = id_end + len(ARGS)
        elif text.startswith(ARGS, e):
            a = e + len(ARGS)
        elif partial and (_pending(text, e, ARGS) or _pending(text, e, CALL_ID)):
            return _Block("stop", calls)
        else:
            return _wait(False, calls, k)
        j = _skip(text, a)
        if j == n:
            return _wait(partial, [*calls, ToolCall(name.group(), "", call_id)], k)
        node = _scan(text, j) if text[j] == "{" else None
        if node is None:
            return _wait(False, calls, k)
        call = ToolCall(name.group(), text[j : node.end], call_id)
        if not node.complete:
            return _wait(partial, [*calls, call], k)
        calls.append(call)
        k = _skip(text, node.end)
        if k == n:
            return _Block("stop", calls) if partial else _Block("ok", calls, k)
        if partial and _pending(text, k, TOOL_CALLS):
            return _Block("stop", calls)
        rest = _NAME.match(text, k)
        if rest is None:
            return _Block("ok", calls, node.end)
        if partial and (
            rest.end() == n
            or _pending(text, rest.end(), ARGS)
            or _pending(text, rest.end(), CALL_ID)
        ):
            return _Block("stop", calls)
        if not (text.startswith(ARGS, rest.end()) or text.startswith(CALL_ID, rest.end())):
            return _Block("ok", calls, node.end)


def _deepseek_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    n = len(text)
    k = i
    if text.startswith(DS_CALLS, k):
        k = _skip(text, k + len(DS_CALLS))
    calls: list[ToolCall] = []
    while True:
        if not text.startswith(DS_CALL, k):
            if partial and _pending(text, k, DS_CALL):
                return _Block("stop", calls)
            return _wait(False, calls, k)
        head_start = k + len(DS_CALL)
        sep = memo.find(DS_SEP, head_start)
        if sep < 0:
            return _wait(partial, calls, k)
        # Matched in place rather than sliced and stripped: a sep far ahead
        # must not cost a copy of the text up to it for every marker.
        head = _DS_NAME.fullmatch(text, head_start, sep)
        if head is None:
            return _wait(False, calls, k)
        a = sep + len(DS_SEP)
        j = _skip(text, a)
        if j == n:
            return _wait(partial, calls, k)
        fenced = False
        if text[j] == "{":  # V3.1: name<sep>{...}
            name = head.group(1)
        else:  # R1/V3: function<sep>name, then a fenced JSON block
            newline = memo.find("\n", a)
            if newline < 0:
                return _wait(partial, calls, k)
            line = _DS_NAME.fullmatch(text, a, newline)
            if line is None:
                return _wait(False, calls, k)
            name = line.group(1)
            j = _skip(text, newline)
            if text.startswith(FENCE, j):
                fenced = True
                lang = re.compile(r"[A-Za-z]*").match(text, j + len(FENCE))
                j = _skip(text, lang.end() if lang else j + len(FENCE))
            elif partial and _pending(text, j, FENCE):
                return _Block("stop", [*calls, ToolCall(name, "")])
            if j == n:
                return _wait(partial, [*calls, ToolCall(name, "")], k)
        node = _scan(text, j) if text[j] == "{" else None
        if node is None:
            return _wait(False, calls, k)
        call = ToolCall(name, text[j : node.end])
        if not node.complete:
            return _wait(partial, [*calls, call], k)
        calls.append(call)
        r = _skip(text, node.end)
        if fenced:
            if text.startswith(FENCE, r):
                r = _skip(text, r + len(FENCE))
            elif partial and _pending(text, r, FENCE):
                return _Block("stop", calls)
        after = _after_call(text, r, partial, calls, (DS_CALL, DS_CALL_END, DS_CALLS_END))
        if isinstance(after, _Block):
            return after
        k = after


def _after_call(
    text: str, r: int, partial: bool, calls: list[ToolCall], markers: tuple[str, str, str]
) -> _Block | int:
    """After a call of a section of calls (DeepSeek, Kimi-K2), ``markers``
    being the call's opener and closer and the section's closer: the block
    to return, or where the next call starts."""
    call_begin, call_end, section_end = markers
    if text.startswith(call_end, r):
        r += len(call_end)
    elif partial and _pending(text, r, call_end):
        return _Block("stop", calls)
    else:
        return _Block("ok", calls, r)
    k = _skip(text, r)
    if text.startswith(section_end, k):
        return _Block("ok", calls, k + len(section_end))
    if partial and (_pending(text, k, section_end) or _pending(text, k, call_begin)):
        return _Block("stop", calls)
    if not text.startswith(call_begin, k):
        return _Block("ok", calls, r)
    return k


def _bare(
    text: str, s: int, partial: bool, generic: bool, llama: bool
) -> tuple[_Block, str] | None:
    """A reply that starts with a JSON object (at ``s``): the block and the
    content it holds, or None when it is not a call (it stays content)."""
    node = _scan(text, s)
    if node is None:
        return None
    if not node.members:
        return (_Block("stop"), "") if partial and not node.complete else None
    first = node.members[0].key
    if generic and first in _GENERIC_KEYS:
        return _generic(text, node, partial)
    if llama and first in _CALL_FIRST_KEYS:
        block = _json_calls(text, s, partial, require_args=True)
        return None if block.status == "broken" else (block, "")
    return None


def _generic(text: str, node: _Value, partial: bool) -> tuple[_Block, str] | None:
    calls: list[ToolCall] = []
    content = ""
    seen: set[str] = set()
    for member in node.members:
        value = member.value
        if value is None:
            break
        if member.key in _GENERIC_KEYS and member.key not in seen:
            seen.add(member.key)
            if member.key == "response":
                if value.kind != "string":
                    return None
                content = value.text
            elif value.kind != ("object" if member.key == "tool_call" else "array"):
                return None
            elif value.items or value.kind == "object" or not value.complete:
                valid, found = _calls_of(text, value, require_args=False)
                if not valid:
                    return None
                calls += found
        if not value.complete:
            break
    if not node.complete:
        return (_Block("stop", calls), content) if partial else None
    return _Block("ok", calls, node.end), content


# --- putting it together -------------------------------------------------------

_BlockParser = Callable[[str, int, bool, _Memo], _Block]


@dataclass(frozen=True)
class _Spec:
    blocks: Mapping[str, _BlockParser]
    generic: bool = False  # a leading {"tool_call(s)"/"response": ...}
    llama: bool = False  # a leading {"name": ..., "parameters": ...}
    think: tuple[str, str] = (THINK, THINK_END)  # what opens and closes reasoning
