"""Reading a chat model's reply: content, reasoning and tool calls.

:func:`parse_chat_output` splits what a model generated into the text meant
for the user, its reasoning (a leading ``<think>...</think>`` block) and the
tool calls it made, for the tool-call conventions in wide use:

============ ===========================================================
format       what a call looks like
============ ===========================================================
``hermes``   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
             (Hermes 2 Pro, Qwen 2.5/3; several blocks may follow each
             other, text around them is content)
``llama3``   ``{"name": ..., "parameters": {...}}`` at the start of the
             reply or after ``<|python_tag|>``, several separated by ``;``
             or newlines; after the tag also ``tool.call(query="...")``
``mistral``  ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]``
             or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (repeatable)
``deepseek`` ``<|tool▁calls▁begin|><|tool▁call▁begin|>function<|tool▁sep|>``
             name, then a fenced JSON block and ``<|tool▁call▁end|>``
             (the bars are full-width, U+FF5C); also V3.1's
             ``<|tool▁call▁begin|>name<|tool▁sep|>{...}<|tool▁call▁end|>``
``gemma``    ````` ```tool_code ````` blocks of ``name(key=value, ...)``
             (literals only, never evaluated; ``print(...)`` around a call
             is dropped), ````` ```json ````` blocks holding a call object,
             and hermes blocks
``generic``  the whole reply is ``{"tool_call": {...}}``,
             ``{"tool_calls": [{...}, ...]}`` or ``{"response": "text"}``
``content``  no tool calls (reasoning is still split off)
``auto``     every marker above except ````` ```json `````, and a reply
             that starts with a generic or llama3 JSON object
============ ===========================================================

Nothing a model writes makes it raise: what does not parse as a call stays
in the content as written. With ``partial=True`` the text is a prefix of a
reply still being generated; for a reply that ends well formed, what comes
back only grows as the text does (the content and reasoning are prefixes of
the final ones, a call shows once its name is complete and its arguments
grow as their JSON arrives), so a stream can be shown by re-parsing the
whole text after every token. :class:`ChatOutputStream` gives the same
results for a stream without re-reading the text that can no longer change.

Choices where conventions differ:

- Content is the text outside the calls, joined as written and stripped of
  surrounding whitespace (while streaming, trailing whitespace is held back
  with it, and so is anything that may be the start of a marker).
- Reasoning is only recognised at the start of the reply (or, with
  ``thinking_started=True``, when the prompt already opened ``<think>``);
  one newline after ``<think>`` and one before ``</think>`` are dropped. A
  ``<think>`` that is never closed makes the rest of the reply reasoning.
- A call's ``arguments`` is the JSON text exactly as the model wrote it;
  a call written without arguments gets ``"{}"``. Calls in Python syntax
  (``tool_code``, ``<|python_tag|>``) get ``json.dumps`` of their keyword
  arguments and show only once their closing parenthesis arrives.
- A bare JSON object counts as a call only when its first key is one a
  call object starts with (``name``, ``type``, ``function``, ``arguments``,
  ``parameters``, ``id``) and it has both a name and arguments.
- A final reply whose call is cut off or broken keeps that text, marker
  included, in the content; calls before it are kept. A call whose JSON is
  complete counts even when its closing tag never came.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CHAT_FORMATS", "ChatOutput", "ChatOutputStream", "ToolCall", "parse_chat_output"]

CHAT_FORMATS: tuple[str, ...] = (
    "auto",
    "content",
    "hermes",
    "llama3",
    "mistral",
    "deepseek",
    "gemma",
    "generic",
)
"""The values :func:`parse_chat_output` takes as ``format``."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the function's name and its arguments as JSON text.

    ``arguments`` is the text the model wrote (a prefix of it while the
    call is still streaming, ``""`` before any of it arrived), or for calls
    written in Python syntax the ``json.dumps`` of their keyword arguments;
    ``id`` is the call id the model wrote, if any (Mistral writes one).
    """

    name: str
    arguments: str
    id: str | None = None

    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or ``None`` while they are not (yet) a
        complete JSON object. Arguments written as a JSON string holding an
        object (``"{\\"a\\": 1}"``) are decoded twice."""
        try:
            value = json.loads(self.arguments, strict=False)
            if isinstance(value, str):
                value = json.loads(value, strict=False)
        except Exception:  # malformed, too deep, too long a number
            return None
        return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class ChatOutput:
    """A parsed reply: the text for the user, the model's reasoning and the
    tool calls in the order it made them."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


def parse_chat_output(
    text: str,
    *,
    format: str = "auto",
    partial: bool = False,
    thinking_started: bool = False,
) -> ChatOutput:
    """Split a model's reply into content, reasoning and tool calls.

    ``format`` is one of :data:`CHAT_FORMATS` (``"auto"`` recognises the
    family from the reply's markers). ``partial=True`` parses a reply that
    is still being generated: text that may yet turn into a marker or a
    call is held back, so successive results only grow.
    ``thinking_started=True`` says the prompt ended inside ``<think>`` (the
    reply starts as reasoning until ``</think>``). Raises ``ValueError``
    for an unknown format and ``TypeError`` when ``text`` is not a string;
    never for anything in the text.

    >>> reply = (
    ...     'Let me look.\\n<tool_call>\\n'
    ...     '{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>'
    ... )
    >>> out = parse_chat_output(reply)
    >>> out.content
    'Let me look.'
    >>> call = out.tool_calls[0]
    >>> call.name, call.arguments, call.parsed_arguments()
    ('get_weather', '{"city": "Paris"}', {'city': 'Paris'})
    >>> parse_chat_output(reply[:66], partial=True).tool_calls
    (ToolCall(name='get_weather', arguments='{"ci', id=None),)
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    spec = _SPECS.get(format) if isinstance(format, str) else None
    if spec is None:
        raise ValueError(f"unknown chat format {format!r}; expected one of {CHAT_FORMATS}")
    try:
        return _parse(text, spec, partial=bool(partial), thinking_started=bool(thinking_started))
    except Exception:  # pragma: no cover - a bug here must not break the caller's stream
        return ChatOutput(content=text.strip())


# --- markers -----------------------------------------------------------------

_THINK = "<think>"
_THINK_END = "</think>"
_TOOL_CALL = "<tool_call>"
_TOOL_CALL_END = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
_DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
_DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
_DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
_DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
_TOOL_CODE = "```tool_code"
_JSON_FENCE = "```json"
_FENCE = "```"

_WS = " \t\r\n"
# The keys a call object may start with, and those of the generic format.
_CALL_FIRST_KEYS = frozenset({"name", "type", "function", "arguments", "parameters", "id"})
_GENERIC_KEYS = frozenset({"tool_call", "tool_calls", "response"})
_NAME = re.compile(r"[\w.\-]+")
# A name between blanks (``\s`` is what ``str.strip()`` removes, and no
# name character is a blank).
_DS_NAME = re.compile(r"\s*([\w.\-]+)\s*")


def _skip(text: str, i: int, chars: str = _WS) -> int:
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i


def _pending(text: str, i: int, word: str) -> bool:
    """Whether ``text[i:]`` (possibly empty) could still grow into ``word``."""
    return len(text) - i < len(word) and word.startswith(text[i:])


def _held_from(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """Where the longest ending of ``text[pos:]`` that begins a marker starts."""
    n = len(text)
    cut = n
    for marker in markers:
        for k in range(min(len(marker) - 1, n - pos), 0, -1):
            if text.endswith(marker[:k]):
                cut = min(cut, n - k)
                break
    return cut


class _Memo:
    """What one parse has found out about its text, kept for later blocks.

    A block that turns out to be text sends the parse on from just after
    its marker, so the next markers' blocks start inside text that was
    already read; these answers keep that from costing a pass over the
    rest of the text per marker."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._found: dict[str, tuple[int, int]] = {}  # needle: (searched from, found at)
        self._closes: dict[int, int] = {}

    def find(self, needle: str, start: int) -> int:
        """``text.find(needle, start)``."""
        known = self._found.get(needle)
        if known is not None:
            since, at = known
            if since <= start and (at < 0 or at >= start):
                return at
        at = self.text.find(needle, start)
        self._found[needle] = (start, at)
        return at

    def close_paren(self, p: int) -> int:
        """Just past the bracket closing ``text[p]``; -1 if the text ends
        first, -2 if the brackets do not match."""
        return _close_paren(self.text, p, self._closes)


# --- a JSON scanner that knows where each value lies and stops at the end ----

_MAX_DEPTH = 128
_PLAIN = re.compile(r'[^"\\]*')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_HEX_CUT = re.compile(r"[0-9a-fA-F]{0,3}")
_ESCAPE_CUT = re.compile(r"(\\(u[0-9a-fA-F]{0,3})?)?")
_NUMBER_RUN = re.compile(r"[-+.eE0-9]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CUT = re.compile(
    r"-|-?(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?[eE][-+]?[0-9]*"
)


class _Node:
    """A JSON value in the text: ``text[start:end]``; ``complete`` is False
    when the text ends inside it (then ``end`` is the end of the text)."""

    __slots__ = ("complete", "end", "items", "kind", "members", "start", "text")

    def __init__(self, kind: str, start: int) -> None:
        self.kind = kind  # "object", "array", "string" or "scalar"
        self.start = start
        self.end = start
        self.complete = False
        self.members: list[_Member] = []  # objects: keys seen whole, in order
        self.items: list[_Node] = []  # arrays
        self.text = ""  # strings: the decoded text so far


class _Member:
    __slots__ = ("key", "value")

    def __init__(self, key: str) -> None:
        self.key = key
        self.value: _Node | None = None


def _scan(text: str, i: int, depth: int = 0) -> _Node | None:
    """The JSON value at ``text[i]``, or None if the text there cannot be
    (the start of) one."""
    if depth > _MAX_DEPTH or i >= len(text):
        return None
    c = text[i]
    if c == "{":
        return _scan_object(text, i, depth)
    if c == "[":
        return _scan_array(text, i, depth)
    if c == '"':
        return _scan_string(text, i)
    if c in "-0123456789":
        return _scan_number(text, i)
    return _scan_literal(text, i)


def _scan_object(text: str, i: int, depth: int) -> _Node | None:
    node = _Node("object", i)
    n = len(text)
    j = _skip(text, i + 1)
    if j < n and text[j] == "}":
        node.complete, node.end = True, j + 1
        return node
    while j < n:
        if text[j] != '"':
            return None
        key = _scan_string(text, j)
        if key is None:
            return None
        if not key.complete:
            break
        member = _Member(key.text)
        node.members.append(member)
        j = _skip(text, key.end)
        if j == n:
            break
        if text[j] != ":":
            return None
        j = _skip(text, j + 1)
        if j == n:
            break
        value = _scan(text, j, depth + 1)
        if value is None:
            return None
        member.value = value
        if not value.complete:
            break
        j = _skip(text, value.end)
        if j == n:
            break
        if text[j] == "}":
            node.complete, node.end = True, j + 1
            return node
        if text[j] != ",":
            return None
        j = _skip(text, j + 1)
    node.end = n
    return node


def _scan_array(text: str, i: int, depth: int) -> _Node | None:
    node = _Node("array", i)
    n = len(text)
    j = _skip(text, i + 1)
    if j < n and text[j] == "]":
        node.complete, node.end = True, j + 1
        return node
    while j < n:
        item = _scan(text, j, depth + 1)
        if item is None:
            return None
        node.items.append(item)
        if not item.complete:
            break
        j = _skip(text, item.end)
        if j == n:
            break
        if text[j] == "]":
            node.complete, node.end = True, j + 1
            return node
        if text[j] != ",":
            return None
        j = _skip(text, j + 1)
    node.end = n
    return node


def _scan_string(text: str, i: int) -> _Node | None:
    node = _Node("string", i)
    n = len(text)
    parts: list[str] = []
    j = i + 1
    while True:
        plain = _PLAIN.match(text, j)
        assert plain is not None  # it matches the empty string
        parts.append(plain.group())
        j = plain.end()
        if j >= n:
            break
        if text[j] == '"':
            node.complete, node.end, node.text = True, j + 1, "".join(parts)
            return node
        if j + 1 == n:  # a backslash, then the end
            break
        escape = text[j + 1]
        if escape in _ESCAPES:
            parts.append(_ESCAPES[escape])
            j += 2
            continue
        if escape != "u":
            return None
        digits = text[j + 2 : j + 6]
        if not _HEX4.fullmatch(digits):
            if j + 2 + len(digits) == n and _HEX_CUT.fullmatch(digits):
                break
            return None
        code = int(digits, 16)
        j += 6
        if 0xD800 <= code < 0xDC00:  # a high surrogate: a low one may follow
            after = text[j : j + 6]
            if len(after) < 6 and j + len(after) == n and _ESCAPE_CUT.fullmatch(after):
                j -= 6
                break
            if after[:2] == "\\u" and _HEX4.fullmatch(after[2:]):
                low = int(after[2:], 16)
                if 0xDC00 <= low < 0xE000:
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    j += 6
        parts.append(chr(code))
    node.end, node.text = n, "".join(parts)
    return node


def _scan_number(text: str, i: int) -> _Node | None:
    node = _Node("scalar", i)
    run = _NUMBER_RUN.match(text, i)
    assert run is not None  # text[i] is a digit or "-"
    if run.end() == len(text):  # it may still grow
        if not _NUMBER_CUT.fullmatch(run.group()):
            return None
        node.end = run.end()
        return node
    if not _NUMBER.fullmatch(run.group()):
        return None
    node.complete, node.end = True, run.end()
    return node


def _scan_literal(text: str, i: int) -> _Node | None:
    node = _Node("scalar", i)
    for word in ("true", "false", "null"):
        if text.startswith(word, i):
            node.complete, node.end = True, i + len(word)
            return node
        if _pending(text, i, word):
            node.end = len(text)
            return node
    return None


# --- call objects --------------------------------------------------------------


def _member(node: _Node, *keys: str) -> _Member | None:
    for member in node.members:
        if member.key in keys:
            return member
    return None


def _call_of(text: str, obj: _Node, require_args: bool) -> tuple[bool, ToolCall | None]:
    """(valid, call) for a call object: valid False when it can never be a
    call, call None while its name (or, with ``require_args``, the key of
    its arguments) has not arrived yet."""
    if obj.kind != "object":
        return False, None
    if require_args and obj.members and obj.members[0].key not in _CALL_FIRST_KEYS:
        return False, None
    target = obj  # {"name": ...} or OpenAI's {"function": {"name": ...}}
    for member in obj.members:
        if member.key == "name":
            break
        if member.key == "function" and member.value is not None:
            if member.value.kind == "object":
                target = member.value
            break
    call_id = None
    for holder in (obj, target):
        found = _member(holder, "id")
        if found and found.value and found.value.kind == "string" and found.value.complete:
            call_id = found.value.text
            break
    name = _member(target, "name")
    if name is None or name.value is None:
        return not target.complete, None
    if name.value.kind != "string":
        return False, None
    if not name.value.complete:
        return True, None
    if not name.value.text:
        return False, None
    args = _member(target, "arguments", "parameters")
    if args is None:
        if require_args:
            return not target.complete, None
        return True, ToolCall(name.value.text, "{}" if target.complete else "", call_id)
    value = args.value
    if value is None:
        return True, ToolCall(name.value.text, "", call_id)
    if value.kind not in ("object", "string"):
        return False, None
    return True, ToolCall(name.value.text, text[value.start : value.end], call_id)


def _calls_of(text: str, node: _Node, require_args: bool) -> tuple[bool, list[ToolCall]]:
    """(valid, the calls visible so far) for a call object or an array of them."""
    if node.kind == "object":
        elements = [node]
    elif node.kind == "array" and (node.items or not node.complete):
        elements = node.items
    else:
        return False, []
    calls: list[ToolCall] = []
    for element in elements:
        valid, call = _call_of(text, element, require_args)
        if not valid:
            return False, []
        if call is None:
            break
        calls.append(call)
    return True, calls


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


def _hermes_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    j = _skip(text, i + len(_TOOL_CALL))
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
    if text.startswith(_TOOL_CALL_END, k):
        return _Block("ok", calls, k + len(_TOOL_CALL_END))
    if partial and _pending(text, k, _TOOL_CALL_END):
        return _Block("stop", calls)
    return _Block("ok", calls, node.end)


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
_BRACKETS = {"(": ")", "[": "]", "{": "}"}
_PY_NAMES: Mapping[str, object] = {"true": True, "false": False, "null": None}


def _close_paren(text: str, p: int, known: dict[int, int]) -> int:
    """Just past the bracket closing ``text[p]``; -1 if the text ends first,
    -2 if the brackets do not match.

    ``known`` gets the answer for every opening bracket met outside quotes
    on the way (a scan from one of them reads the same characters in the
    same state, so it ends where this one does or where its bracket closes),
    and answers for them later without a scan."""
    if p in known:
        return known[p]
    n = len(text)
    opened: list[tuple[str, int]] = []  # (the closing bracket, where it opened)
    k = p
    end = -1
    while k < n and end == -1:
        c = text[k]
        if c in "\"'":
            quote = c * 3 if text.startswith(c * 3, k) else c
            k += len(quote)
            while True:
                if k >= n:
                    break
                if text[k] == "\\":
                    k += 2
                elif text.startswith(quote, k):
                    k += len(quote)
                    break
                elif text[k] == "\n" and len(quote) == 1:
                    end = -2
                    break
                else:
                    k += 1
            continue
        if c in _BRACKETS:
            opened.append((_BRACKETS[c], k))
        elif c in ")]}":
            if not opened or opened[-1][0] != c:
                end = -2
                break
            known[opened.pop()[1]] = k + 1
            if not opened:
                return k + 1
        k += 1
    for _, at in opened:
        known[at] = end
    return end


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
    j = _skip(text, i + len(_PYTHON_TAG))
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
    if text.startswith(_FENCE, k):
        return _Block("ok", block.calls, k + len(_FENCE))
    if partial and _pending(text, k, _FENCE):
        return _Block("stop", block.calls)
    return block


def _tool_code_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    k = i + len(_TOOL_CODE)
    if k == len(text):
        return _wait(partial, [])
    if text[k] not in _WS:
        return _BROKEN
    return _fence_close(text, _python_calls(text, k, partial, memo), partial)


def _json_fence_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    k = i + len(_JSON_FENCE)
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


def _mistral_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    n = len(text)
    k = _skip(text, i + len(_TOOL_CALLS))
    if k == n:
        return _wait(partial, [])
    if text[k] in "{[":  # v0.3: a JSON array (or object) of calls
        node = _scan(text, k)
        if node is None:
            return _BROKEN
        valid, calls = _calls_of(text, node, require_args=False)
        if not valid:
            return _BROKEN
        if not node.complete:
            return _wait(partial, calls)
        return _Block("ok", calls, node.end)
    calls = []  # name[CALL_ID]id[ARGS]{...}, possibly repeated
    while True:
        name = _NAME.match(text, k)
        if name is None:
            return _wait(False, calls, k)
        e = name.end()
        call_id = None
        if text.startswith(_CALL_ID, e):
            found = _NAME.match(text, e + len(_CALL_ID))
            id_end = found.end() if found else e + len(_CALL_ID)
            if partial and _pending(text, id_end, _ARGS):
                return _Block("stop", calls)
            if not text.startswith(_ARGS, id_end):
                return _wait(False, calls, k)
            call_id = text[e + len(_CALL_ID) : id_end]
            a = id_end + len(_ARGS)
        elif text.startswith(_ARGS, e):
            a = e + len(_ARGS)
        elif partial and (_pending(text, e, _ARGS) or _pending(text, e, _CALL_ID)):
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
        if partial and _pending(text, k, _TOOL_CALLS):
            return _Block("stop", calls)
        rest = _NAME.match(text, k)
        if rest is None:
            return _Block("ok", calls, node.end)
        if partial and (
            rest.end() == n
            or _pending(text, rest.end(), _ARGS)
            or _pending(text, rest.end(), _CALL_ID)
        ):
            return _Block("stop", calls)
        if not (text.startswith(_ARGS, rest.end()) or text.startswith(_CALL_ID, rest.end())):
            return _Block("ok", calls, node.end)


def _deepseek_block(text: str, i: int, partial: bool, memo: _Memo) -> _Block:
    n = len(text)
    k = i
    if text.startswith(_DS_CALLS, k):
        k = _skip(text, k + len(_DS_CALLS))
    calls: list[ToolCall] = []
    while True:
        if not text.startswith(_DS_CALL, k):
            if partial and _pending(text, k, _DS_CALL):
                return _Block("stop", calls)
            return _wait(False, calls, k)
        head_start = k + len(_DS_CALL)
        sep = memo.find(_DS_SEP, head_start)
        if sep < 0:
            return _wait(partial, calls, k)
        # Matched in place rather than sliced and stripped: a sep far ahead
        # must not cost a copy of the text up to it for every marker.
        head = _DS_NAME.fullmatch(text, head_start, sep)
        if head is None:
            return _wait(False, calls, k)
        a = sep + len(_DS_SEP)
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
            if text.startswith(_FENCE, j):
                fenced = True
                lang = re.compile(r"[A-Za-z]*").match(text, j + len(_FENCE))
                j = _skip(text, lang.end() if lang else j + len(_FENCE))
            elif partial and _pending(text, j, _FENCE):
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
            if text.startswith(_FENCE, r):
                r = _skip(text, r + len(_FENCE))
            elif partial and _pending(text, r, _FENCE):
                return _Block("stop", calls)
        if text.startswith(_DS_CALL_END, r):
            r += len(_DS_CALL_END)
        elif partial and _pending(text, r, _DS_CALL_END):
            return _Block("stop", calls)
        else:
            return _Block("ok", calls, r)
        k = _skip(text, r)
        if text.startswith(_DS_CALLS_END, k):
            return _Block("ok", calls, k + len(_DS_CALLS_END))
        if partial and (_pending(text, k, _DS_CALLS_END) or _pending(text, k, _DS_CALL)):
            return _Block("stop", calls)
        if not text.startswith(_DS_CALL, k):
            return _Block("ok", calls, r)


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


def _generic(text: str, node: _Node, partial: bool) -> tuple[_Block, str] | None:
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


_DEEPSEEK = {_DS_CALLS: _deepseek_block, _DS_CALL: _deepseek_block}
_SPECS: Mapping[str, _Spec] = {
    "auto": _Spec(
        {
            _TOOL_CALL: _hermes_block,
            _PYTHON_TAG: _python_tag_block,
            _TOOL_CALLS: _mistral_block,
            **_DEEPSEEK,
            _TOOL_CODE: _tool_code_block,
        },
        generic=True,
        llama=True,
    ),
    "content": _Spec({}),
    "hermes": _Spec({_TOOL_CALL: _hermes_block}),
    "llama3": _Spec({_PYTHON_TAG: _python_tag_block}, llama=True),
    "mistral": _Spec({_TOOL_CALLS: _mistral_block}),
    "deepseek": _Spec(_DEEPSEEK),
    "gemma": _Spec(
        {_TOOL_CODE: _tool_code_block, _JSON_FENCE: _json_fence_block, _TOOL_CALL: _hermes_block}
    ),
    "generic": _Spec({}, generic=True),
}


def _split_reasoning(text: str, partial: bool, thinking_started: bool) -> tuple[str, str]:
    """(reasoning, the rest of the reply)."""
    if thinking_started:
        start = 0
    else:
        s = _skip(text, 0)
        if not text.startswith(_THINK, s):
            if partial and s < len(text) and _pending(text, s, _THINK):
                return "", ""
            return "", text
        start = s + len(_THINK)
    close = text.find(_THINK_END, start)
    if close >= 0:
        reasoning, rest = text[start:close], text[close + len(_THINK_END) :]
    else:
        end = _held_from(text, start, (_THINK_END,)) if partial else len(text)
        reasoning, rest = text[start:end], ""
    return _trim_reasoning(reasoning), rest


def _trim_reasoning(reasoning: str) -> str:
    """Drop one newline after ``<think>`` and one before ``</think>``."""
    if reasoning.startswith("\n"):
        reasoning = reasoning[1:]
    if reasoning.endswith("\n"):
        reasoning = reasoning[:-1]
    return reasoning


def _parse(text: str, spec: _Spec, *, partial: bool, thinking_started: bool) -> ChatOutput:
    reasoning, body = _split_reasoning(text, partial, thinking_started)
    parsed = _parse_body(body, spec, partial, at_start=True)
    return _output(parsed.pieces, reasoning, parsed.calls)


@dataclass
class _Body:
    """The reply after its reasoning (or a part of it), parsed: content
    pieces and calls in order.

    ``settled`` is where the parse can no longer change: the first
    ``settled`` characters give the first ``settled_pieces`` pieces and
    ``settled_calls`` calls whatever text is added (to a partial or the
    final parse), and what follows parses as if it were a reply of its own
    that does not start the body (no bare JSON call)."""

    pieces: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    settled: int = 0
    settled_pieces: int = 0
    settled_calls: int = 0

    def settle(self, at: int) -> None:
        self.settled = at
        self.settled_pieces = len(self.pieces)
        self.settled_calls = len(self.calls)


def _parse_body(body: str, spec: _Spec, partial: bool, at_start: bool) -> _Body:
    """Parse ``body``; ``at_start`` says it starts the reply's body, where a
    bare JSON call may stand (for the formats that have those)."""
    out = _Body()
    memo = _Memo(body)
    pos = 0
    settles = True
    if at_start and (spec.generic or spec.llama):
        s = _skip(body, 0)
        settles = s < len(body)  # while the body is blank, a bare call may still come
        found = (
            _bare(body, s, partial, spec.generic, spec.llama) if body[s : s + 1] == "{" else None
        )
        if found is not None:
            block, content = found
            out.pieces.append(content)
            out.calls += block.calls
            if block.status == "stop":
                return out
            pos = block.end
            out.settle(pos)
    markers = tuple(spec.blocks)
    while True:
        i, marker = _first_marker(memo, pos, markers)
        if marker is None:
            # While streaming, what may be the start of a marker is held back.
            end = _held_from(body, pos, markers) if partial else len(body)
            out.pieces.append(body[pos:end])
            if settles:
                out.settle(end)
            break
        out.pieces.append(body[pos:i])
        block = spec.blocks[marker](body, i, partial, memo)
        if block.status == "broken":
            out.pieces.append(marker)
            pos = i + len(marker)
            if settles:
                out.settle(pos)
            continue
        if block.status == "stop":
            if settles:
                out.settle(i)
            out.calls += block.calls
            break
        out.calls += block.calls
        pos = max(block.end, i + len(marker))
        if settles:
            out.settle(pos)
    return out


def _first_marker(memo: _Memo, pos: int, markers: tuple[str, ...]) -> tuple[int, str | None]:
    best, found = len(memo.text), None
    for marker in markers:
        i = memo.find(marker, pos)
        if 0 <= i < best:
            best, found = i, marker
    return best, found


def _output(pieces: list[str], reasoning: str, calls: list[ToolCall]) -> ChatOutput:
    return ChatOutput("".join(pieces).strip(), reasoning, tuple(calls))


# --- streaming ------------------------------------------------------------------


class ChatOutputStream:
    """Parse a reply while it streams, reading each piece about once.

    ``feed(piece)`` adds text and returns what :func:`parse_chat_output`
    with ``partial=True`` returns for all the text fed so far; ``finish()``
    returns the final parse (``partial=False``). Both are equal to those
    calls, not approximations; ``format`` and ``thinking_started`` mean what
    they mean there, and ``text`` is all the text fed.

    The stream keeps the parse of the reply's settled start: the reasoning
    once ``</think>`` came, and the content and calls up to the last point
    that later text cannot change (text before which no marker can start,
    blocks that ended or turned out to be text). Each piece makes it re-read
    only the text after that point. In content and reasoning this is the
    piece and at most a marker's length held back, so the work there is
    linear in the reply. It is not linear while a block stays open: a call
    whose arguments are still arriving is re-read from its marker with each
    piece, and a reply that starts with a JSON object (``generic``, a bare
    ``llama3`` call, ``auto``) is re-read from its start until that object
    is complete (the whole reply, for a generic ``{"response": ...}``).
    Each ``feed`` also builds the returned strings, a copy of the content
    and reasoning so far.

    >>> stream = ChatOutputStream("hermes")
    >>> stream.feed("Let me look.\\n<tool_").content
    'Let me look.'
    >>> stream.feed('call>\\n{"name": "get_weather", "arguments": {"ci').tool_calls
    (ToolCall(name='get_weather', arguments='{"ci', id=None),)
    >>> out = stream.feed('ty": "Paris"}}\\n</tool_call>')
    >>> out.content, out.tool_calls[0].arguments
    ('Let me look.', '{"city": "Paris"}')
    >>> stream.finish() == parse_chat_output(stream.text, format="hermes")
    True
    """

    def __init__(self, format: str = "auto", *, thinking_started: bool = False) -> None:
        spec = _SPECS.get(format) if isinstance(format, str) else None
        if spec is None:
            raise ValueError(f"unknown chat format {format!r}; expected one of {CHAT_FORMATS}")
        self._format = format
        self._spec = spec
        self._thinking_started = bool(thinking_started)
        self._chunks: list[str] = []
        self._failed = False
        # Where the reply is: "head" (no character but blanks yet, or the
        # start of what may be <think>), "think" (in the reasoning) or
        # "body" (after it, or with no reasoning).
        self._phase = "think" if self._thinking_started else "head"
        self._head = ""  # the reply so far, without leading blanks
        self._thought = ""  # the reasoning so far, before </think> was found
        self._reasoning = ""  # the reasoning, once </think> closed it
        self._content = ""  # the settled content pieces, joined
        self._calls: list[ToolCall] = []  # the settled calls
        self._tail = ""  # the body after its settled part
        self._at_start = True  # whether the tail starts the body
        self._parsed_chars = 0  # characters handed to the parser (tests read it)

    @property
    def text(self) -> str:
        """All the text fed so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def feed(self, piece: str) -> ChatOutput:
        """Add ``piece`` to the reply and return the partial parse of all of it."""
        if not isinstance(piece, str):
            raise TypeError(f"piece must be a str, got {type(piece).__name__}")
        if piece:
            self._chunks.append(piece)
        if not self._failed:
            try:
                return self._feed(piece)
            except Exception:  # pragma: no cover - a bug here must not break the caller's stream
                self._failed = True
        return self._whole(partial=True)  # pragma: no cover

    def finish(self) -> ChatOutput:
        """The final parse of all the text fed. The stream is left as it was."""
        if not self._failed:
            try:
                return self._finish()
            except Exception:  # pragma: no cover
                self._failed = True
        return self._whole(partial=False)  # pragma: no cover

    def _whole(self, partial: bool) -> ChatOutput:  # pragma: no cover
        return parse_chat_output(
            self.text,
            format=self._format,
            partial=partial,
            thinking_started=self._thinking_started,
        )

    def _feed(self, piece: str) -> ChatOutput:
        if self._phase == "head":
            head = (self._head + piece).lstrip(_WS)
            self._parsed_chars += len(head)
            if head.startswith(_THINK):
                self._phase, self._head = "think", ""
                piece = head[len(_THINK) :]
            elif not head or _pending(head, 0, _THINK):
                self._head = head
                return ChatOutput("")
            else:
                self._phase, self._head = "body", ""
                piece = head
        if self._phase == "think":
            seen = len(self._thought)
            thought = self._thought + piece
            close = thought.find(_THINK_END, max(0, seen - len(_THINK_END) + 1))
            self._parsed_chars += len(piece) + len(_THINK_END) - 1
            if close < 0:
                self._thought = thought
                held = _held_from(thought, 0, (_THINK_END,))
                return ChatOutput("", _trim_reasoning(thought[:held]))
            self._phase, self._thought = "body", ""
            self._reasoning = _trim_reasoning(thought[:close])
            piece = thought[close + len(_THINK_END) :]
        tail = self._tail + piece
        if self._at_start:
            # Blanks that start the body end up stripped off the content,
            # and a bare JSON call is looked for after them.
            tail = tail.lstrip(_WS)
        self._parsed_chars += len(tail)
        body = _parse_body(tail, self._spec, True, self._at_start)
        pieces, calls = body.pieces, body.calls
        if body.settled:
            self._content += "".join(pieces[: body.settled_pieces])
            self._calls += calls[: body.settled_calls]
            pieces, calls = pieces[body.settled_pieces :], calls[body.settled_calls :]
            tail = tail[body.settled :]
            self._at_start = False
        self._tail = tail
        return ChatOutput(
            (self._content + "".join(pieces)).strip(), self._reasoning, (*self._calls, *calls)
        )

    def _finish(self) -> ChatOutput:
        if self._phase == "head":
            return _parse(self._head, self._spec, partial=False, thinking_started=False)
        if self._phase == "think":
            return ChatOutput("", _trim_reasoning(self._thought))
        body = _parse_body(self._tail, self._spec, False, self._at_start)
        return ChatOutput(
            (self._content + "".join(body.pieces)).strip(),
            self._reasoning,
            (*self._calls, *body.calls),
        )
