"""The reading primitives of the reply parser: blank skipping, markers that
may still be arriving, a memo of searches, bracket matching, and a JSON
scanner that knows where each value lies and stops at the text's end; and
tool-call objects read from the scanned JSON."""

from __future__ import annotations

import re

from lloyal.chat._types import ToolCall

_BRACKETS = {"(": ")", "[": "]", "{": "}"}
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


class _Value:
    """A JSON value in the text: ``text[start:end]``; ``complete`` is False
    when the text ends inside it (then ``end`` is the end of the text)."""

    __slots__ = ("complete", "end", "items", "kind", "members", "start", "text")

    def __init__(self, kind: str, start: int) -> None:
        self.kind = kind  # "object", "array", "string" or "scalar"
        self.start = start
        self.end = start
        self.complete = False
        self.members: list[_Member] = []  # objects: keys seen whole, in order
        self.items: list[_Value] = []  # arrays
        self.text = ""  # strings: the decoded text so far


class _Member:
    __slots__ = ("key", "value")

    def __init__(self, key: str) -> None:
        self.key = key
        self.value: _Value | None = None


def _scan(text: str, i: int, depth: int = 0) -> _Value | None:
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


def _scan_object(text: str, i: int, depth: int) -> _Value | None:
    node = _Value("object", i)
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


def _scan_array(text: str, i: int, depth: int) -> _Value | None:
    node = _Value("array", i)
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


def _scan_string(text: str, i: int) -> _Value | None:
    node = _Value("string", i)
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


def _scan_number(text: str, i: int) -> _Value | None:
    node = _Value("scalar", i)
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


def _scan_literal(text: str, i: int) -> _Value | None:
    node = _Value("scalar", i)
    for word in ("true", "false", "null"):
        if text.startswith(word, i):
            node.complete, node.end = True, i + len(word)
            return node
        if _pending(text, i, word):
            node.end = len(text)
            return node
    return None


# --- call objects --------------------------------------------------------------


def _member(node: _Value, *keys: str) -> _Member | None:
    for member in node.members:
        if member.key in keys:
            return member
    return None


def _call_of(text: str, obj: _Value, require_args: bool) -> tuple[bool, ToolCall | None]:
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


def _calls_of(text: str, node: _Value, require_args: bool) -> tuple[bool, list[ToolCall]]:
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
