"""Block parsers of the families whose calls are tagged text rather than
one JSON object after one marker: Qwen3-Coder and GLM-4.5 (a parameter per
tag, values as raw text), Kimi-K2 (a section of indexed calls), Granite and
Command-R (a JSON list after a marker), GPT-OSS (harmony's ``to=functions.``
recipient), and the markers of structure that are not content (harmony's
channel headers, Command-R's response tags).

Arguments written as tags come back as a JSON object: a value that parses
as JSON and is not a string (``42``, ``true``, ``[1, 2]``, ``{...}``) is
kept as that JSON, anything else becomes a JSON string. While a call
streams, its arguments show the parameters complete so far, without the
closing brace, so that they only grow.
"""

from __future__ import annotations

import json
import re

from lloyal.chat._blocks import _BROKEN, _after_call, _Block, _BlockParser, _json_after, _wait
from lloyal.chat._markers import (
    ARG_KEY,
    ARG_VALUE,
    CR_ACTION,
    GRANITE_CALL,
    HARMONY_CALL,
    HARMONY_MESSAGE,
    KIMI_ARGS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_SECTION,
    KIMI_SECTION_END,
    QWEN_FUNCTION,
    QWEN_PARAMETER,
    TOOL_CALL,
    TOOL_CALL_END,
)
from lloyal.chat._scan import _NAME, _member, _Memo, _pending, _scan, _skip
from lloyal.chat._types import ToolCall

# --- arguments written as tags ----------------------------------------------------


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _json_value(raw: str) -> str:
    """A tagged value as JSON text (see the module docs): never ``NaN`` or
    ``Infinity``, which are not JSON, and a value nested too deep for the
    parser is a string."""
    try:
        value = json.loads(raw, parse_constant=_not_json)
        if not isinstance(value, str):
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        pass
    return json.dumps(raw, ensure_ascii=False)


def _object(members: list[tuple[str, str]], complete: bool) -> str:
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_json_value(v)}" for k, v in members)
    return "{" + body + ("}" if complete else "")


def _trim(value: str) -> str:
    """One newline after the opening tag and one before the closing one go."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _tagged_members(
    text: str, k: int, open_tag: str, close_key: str, value_tags: tuple[str, str], end_tag: str
) -> tuple[str, list[tuple[str, str]], int]:
    """Read ``open_tag KEY close_key VALUE value_close`` members from ``k``
    until ``end_tag``. Returns (status, members, where it stopped): status
    "done" (``end_tag`` read), "open" (the text ends first) or "bad"."""
    value_open, value_close = value_tags
    members: list[tuple[str, str]] = []
    n = len(text)
    while True:
        k = _skip(text, k)
        if text.startswith(end_tag, k):
            return "done", members, k + len(end_tag)
        if k == n or _pending(text, k, end_tag) or _pending(text, k, open_tag):
            return "open", members, k
        if not text.startswith(open_tag, k):
            return "bad", members, k
        key_end = text.find(close_key, k + len(open_tag))
        if key_end < 0:
            return "open", members, k
        key = text[k + len(open_tag) : key_end].strip()
        if not key or "<" in key:
            return "bad", members, k
        v = key_end + len(close_key)
        if value_open:
            v = _skip(text, v)
            if not text.startswith(value_open, v):
                return ("open" if _pending(text, v, value_open) else "bad"), members, k
            v += len(value_open)
        close = text.find(value_close, v)
        if close < 0:
            return "open", members, k
        members.append((key, _trim(text[v:close])))
        k = close + len(value_close)


def _open(partial: bool, calls: list[ToolCall], current: ToolCall, k: int) -> _Block:
    """A call whose tags have not all arrived: shown while streaming; in a
    final reply it is text, and the calls before it are kept."""
    return _wait(partial, [*calls, current] if partial else calls, k)


def _qwen_coder_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
    </function></tool_call>``, several blocks in a row."""
    calls: list[ToolCall] = []
    k = i
    while True:
        j = _skip(text, k + len(TOOL_CALL))
        if not text.startswith(QWEN_FUNCTION, j):
            if partial and _pending(text, j, QWEN_FUNCTION):
                return _Block("stop", calls)
            return _wait(False, calls, k)
        close = text.find(">", j + len(QWEN_FUNCTION))
        if close < 0:
            return _wait(partial, calls, k)
        name = text[j + len(QWEN_FUNCTION) : close].strip()
        if not _NAME.fullmatch(name):
            return _wait(False, calls, k)
        status, members, r = _tagged_members(
            text, close + 1, QWEN_PARAMETER, ">", ("", "</parameter>"), "</function>"
        )
        if status == "bad":
            return _wait(False, calls, k)
        if status == "open":
            return _open(partial, calls, ToolCall(name, _object(members, False)), k)
        calls.append(ToolCall(name, _object(members, True)))
        r = _skip(text, r)
        if text.startswith(TOOL_CALL_END, r):
            r += len(TOOL_CALL_END)
        elif partial and _pending(text, r, TOOL_CALL_END):
            return _Block("stop", calls)
        k = _skip(text, r)
        if not text.startswith(TOOL_CALL, k):
            if partial and _pending(text, k, TOOL_CALL):
                return _Block("stop", calls)
            return _Block("ok", calls, r)


def _glm_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
    </tool_call>``, several blocks in a row."""
    calls: list[ToolCall] = []
    k = i
    while True:
        j = _skip(text, k + len(TOOL_CALL))
        name = _NAME.match(text, j)
        if name is None:
            return _wait(partial and j == len(text), calls, k)
        if name.end() == len(text):  # the name may still grow
            return _wait(partial, calls, k)
        after = _skip(text, name.end())
        if after == len(text):
            return _wait(partial, calls, k)
        if not (text.startswith(ARG_KEY, after) or text.startswith(TOOL_CALL_END, after)):
            if partial and (_pending(text, after, ARG_KEY) or _pending(text, after, TOOL_CALL_END)):
                return _wait(partial, calls, k)
            return _wait(False, calls, k)
        status, members, r = _tagged_members(
            text, after, ARG_KEY, "</arg_key>", (ARG_VALUE, "</arg_value>"), TOOL_CALL_END
        )
        if status == "bad":
            return _wait(False, calls, k)
        if status == "open":
            return _open(partial, calls, ToolCall(name.group(), _object(members, False)), k)
        calls.append(ToolCall(name.group(), _object(members, True)))
        k = _skip(text, r)
        if not text.startswith(TOOL_CALL, k):
            if partial and _pending(text, k, TOOL_CALL):
                return _Block("stop", calls)
            return _Block("ok", calls, r)


# --- calls with a JSON body ---------------------------------------------------------

_KIMI_ID = re.compile(r"\s*(?:functions\.)?([\w\-]+(?:\.[\w\-]+)*?)(?::(\d+))?\s*")


def _kimi_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{...}<|tool_call_end|>...
    <|tool_calls_section_end|>`` (the section markers may be missing)."""
    n = len(text)
    k = i
    if text.startswith(KIMI_SECTION, k):
        k = _skip(text, k + len(KIMI_SECTION))
    calls: list[ToolCall] = []
    while True:
        if not text.startswith(KIMI_CALL, k):
            if partial and _pending(text, k, KIMI_CALL):
                return _Block("stop", calls)
            if text.startswith(KIMI_SECTION_END, k):
                return _Block("ok", calls, k + len(KIMI_SECTION_END)) if calls else _BROKEN
            if partial and calls and _pending(text, k, KIMI_SECTION_END):
                return _Block("stop", calls)
            return _wait(False, calls, k)
        head = k + len(KIMI_CALL)
        args_at = memo.find(KIMI_ARGS, head)
        if args_at < 0:
            return _wait(partial, calls, k)
        ident = _KIMI_ID.fullmatch(text, head, args_at)
        if ident is None:
            return _wait(False, calls, k)
        call_id = text[head:args_at].strip()
        j = _skip(text, args_at + len(KIMI_ARGS))
        if j == n:
            return _wait(partial, [*calls, ToolCall(ident.group(1), "", call_id)], k)
        node = _scan(text, j) if text[j] == "{" else None
        if node is None:
            return _wait(False, calls, k)
        call = ToolCall(ident.group(1), text[j : node.end], call_id)
        if not node.complete:
            return _wait(partial, [*calls, call], k)
        calls.append(call)
        r = _skip(text, node.end)
        after = _after_call(text, r, partial, calls, (KIMI_CALL, KIMI_CALL_END, KIMI_SECTION_END))
        if isinstance(after, _Block):
            return after
        k = after


_granite_block = _json_after(GRANITE_CALL, "")


def _command_r_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``<|START_ACTION|>[{"tool_call_id": "0", "tool_name": NAME,
    "parameters": {...}}, ...]<|END_ACTION|>``."""
    j = _skip(text, i + len(CR_ACTION[0]))
    if j == len(text):
        return _wait(partial, [])
    node = _scan(text, j) if text[j] == "[" else None
    if node is None:
        return _BROKEN
    calls: list[ToolCall] = []
    for item in node.items:
        if item.kind != "object":
            return _BROKEN
        name = _member(item, "tool_name")
        if name is None or name.value is None or not name.value.complete:
            if item.complete:
                return _BROKEN
            break
        if name.value.kind != "string" or not name.value.text:
            return _BROKEN
        found = _member(item, "tool_call_id")
        call_id = None
        if found and found.value and found.value.kind == "string" and found.value.complete:
            call_id = found.value.text
        args = _member(item, "parameters")
        if args is None or args.value is None:
            calls.append(ToolCall(name.value.text, "{}" if item.complete else "", call_id))
            if not item.complete:
                break
            continue
        if args.value.kind != "object":
            return _BROKEN
        calls.append(ToolCall(name.value.text, text[args.value.start : args.value.end], call_id))
        if not item.complete:
            break
    if not node.complete:
        return _wait(partial, calls)
    if not calls:
        return _BROKEN
    r = _skip(text, node.end)
    if text.startswith(CR_ACTION[1], r):
        return _Block("ok", calls, r + len(CR_ACTION[1]))
    if partial and _pending(text, r, CR_ACTION[1]):
        return _Block("stop", calls)
    return _Block("ok", calls, node.end)


def _harmony_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    """``to=functions.NAME`` then, after any header words,
    ``<|message|>{...}`` and ``<|call|>``."""
    n = len(text)
    start = i + len(HARMONY_CALL)
    name = _NAME.match(text, start)
    if name is None:
        return _wait(partial and start == n, [])
    if name.end() == n:  # the name may still grow
        return _wait(partial, [])
    message = memo.find(HARMONY_MESSAGE, name.end())
    if message < 0:
        return _wait(partial, [])
    header = text[name.end() : message]
    if "\n" in header or len(header) > 64:
        return _BROKEN
    j = _skip(text, message + len(HARMONY_MESSAGE))
    if j == n:
        return _wait(partial, [ToolCall(name.group(), "")])
    node = _scan(text, j) if text[j] == "{" else None
    if node is None:
        return _BROKEN
    call = ToolCall(name.group(), text[j : node.end])
    if not node.complete:
        return _wait(partial, [call])
    r = _skip(text, node.end)
    for end in ("<|call|>", "<|end|>"):
        if text.startswith(end, r):
            return _Block("ok", [call], r + len(end))
        if partial and _pending(text, r, end):
            return _Block("stop", [call])
    return _Block("ok", [call], node.end)


def _drop_block(marker: str) -> _BlockParser:
    """A marker of structure, not content: it is skipped."""

    def block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
        return _Block("ok", [], i + len(marker))

    return block
