"""ChatOutputStream: the same parses as parse_chat_output, for linear work
(no model needed)."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lloyal import chat
from lloyal.chat.output import CHAT_FORMATS, ChatOutputStream, parse_chat_output

from tests.test_chat_output import (
    BROKEN,
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_CALLS_END,
    DS_SEP,
    FRAGMENTS,
    WELL_FORMED,
)

# Replies with several blocks and content between them, and texts that
# stop at awkward places.
MORE = [
    'First. <tool_call>{"name": "a", "arguments": {"x": "<tool_call>"}}</tool_call> then '
    "[not a call] and `code` <b>bold</b>\n<tool_call>\n"
    '{"name": "b", "arguments": {}}\n</tool_call>\nDone.  ',
    '<think>\na < b\n</think>\n\n{"name": "x"} <tool_call>{"name": "a"}</tool_call>',
    "Answer: </think> <think> and more",
    " \n\t <think>\nhm</think>   tail",
    "<think>\nstill </thin",
    '  {"name": "a", "parameters": {"q": 1}}\nSo.',
    '{"a": 1} and {"name": "b", "parameters": {}}',
    '{"response": "A long answer with \\"quotes\\", \\u00e9 and [brackets]."}',
    'Hi [TOOL_CALLS]f[ARGS]{"a": [1, 2]} trailing [TOOL_CALL text',
    f'Pre {DS_CALLS}{DS_CALL}f{DS_SEP}{{"a": 1}}{DS_CALL_END}{DS_CALLS_END} post '
    f"{DS_CALL}bad name{DS_SEP}",
    '```tool_code\nf(a=1)\n```\nthen ```json\n{"name": "g", "parameters": {}}\n```'
    " and ```tool_code\ng(",
    "Ok.<|python_tag|>a.call(q='x)')\nb.call(q=\"(\"); c(d=[1, {'e': None}])",
]

# (text, thinking_started) for every format.
REPLIES = [(c.text, c.thinking_started) for c in WELL_FORMED + BROKEN] + [(t, False) for t in MORE]
SAMPLES = [
    pytest.param(text, started, fmt, id=f"{i}-{fmt}")
    for i, (text, started) in enumerate(REPLIES)
    for fmt in CHAT_FORMATS
]


def _check_stream(pieces: list[str], fmt: str, thinking_started: bool) -> ChatOutputStream:
    """Feed ``pieces``; every result must be the partial parse of the text so far."""
    stream = ChatOutputStream(fmt, thinking_started=thinking_started)
    text = ""
    for piece in pieces:
        text += piece
        got = stream.feed(piece)
        want = parse_chat_output(text, format=fmt, partial=True, thinking_started=thinking_started)
        assert got == want, f"{fmt} after {text!r}"
    assert stream.text == text
    final = parse_chat_output(text, format=fmt, thinking_started=thinking_started)
    assert stream.finish() == final, f"{fmt} final {text!r}"
    return stream


def _split(text: str, cuts: list[int]) -> list[str]:
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("text", "thinking_started", "fmt"), SAMPLES)
def test_stream_char_by_char(text: str, thinking_started: bool, fmt: str) -> None:
    _check_stream(list(text), fmt, thinking_started)


@pytest.mark.parametrize(("text", "thinking_started", "fmt"), SAMPLES)
def test_stream_split_anywhere(text: str, thinking_started: bool, fmt: str) -> None:
    for k in range(len(text) + 1):
        _check_stream([text[:k], text[k:]], fmt, thinking_started)
    rng = random.Random(text)
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        _check_stream(_split(text, cuts), fmt, thinking_started)


def test_finish_leaves_the_stream_as_it_was() -> None:
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> more'
    stream = ChatOutputStream("hermes")
    for k in range(len(text)):
        stream.feed(text[k])
        assert stream.finish() == parse_chat_output(text[: k + 1], format="hermes")
    assert stream.feed("") == parse_chat_output(text, format="hermes", partial=True)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown chat format"):
        ChatOutputStream("chatml")
    with pytest.raises(TypeError):
        ChatOutputStream().feed(b"x")  # type: ignore[arg-type]
    assert ChatOutputStream().finish() == parse_chat_output("")
    assert "ChatOutputStream" in chat.__all__


# --- random text, split at random -------------------------------------------------

texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=30).map(
    "".join
)


@settings(max_examples=200, deadline=None)
@given(
    text=texts,
    fmt=st.sampled_from(CHAT_FORMATS),
    thinking_started=st.booleans(),
    data=st.data(),
)
def test_random_text_streams_as_parsed(
    text: str, fmt: str, thinking_started: bool, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12).map(sorted))
    _check_stream(_split(text, cuts), fmt, thinking_started)


# --- work: each piece is read about once ----------------------------------------------

WORDS = "the quick brown fox jumps over a lazy dog; 3 < 4, [see] `x` and <b>bold</b>.\n"


def _reply(rng: random.Random, size: int) -> list[str]:
    """About ``size`` pieces of 1 to 5 characters, as a tokenizer would cut prose."""
    text = "".join(rng.choice(WORDS.split(" ")) + " " for _ in range(size))
    pieces = []
    k = 0
    while k < len(text) and len(pieces) < size:
        step = rng.randint(1, 5)
        pieces.append(text[k : k + step])
        k += step
    return pieces


CALL = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
CALL += "</tool_call>\n"


@pytest.mark.parametrize("fmt", CHAT_FORMATS)
@pytest.mark.parametrize("with_call", [False, True], ids=["plain", "call"])
def test_streaming_reads_each_piece_about_once(fmt: str, with_call: bool) -> None:
    rng = random.Random(7)
    pieces = _reply(rng, 2000)
    if with_call:
        pieces[1000:1000] = [CALL[k : k + 3] for k in range(0, len(CALL), 3)]
    stream = ChatOutputStream(fmt)
    for piece in pieces:
        out = stream.feed(piece)
    text = "".join(pieces)
    assert out == parse_chat_output(text, format=fmt, partial=True)
    assert stream.finish() == parse_chat_output(text, format=fmt)
    if with_call and fmt in ("auto", "hermes", "gemma"):
        assert [c.name for c in out.tool_calls] == ["get_weather"]
    # Re-reading all the text for every piece would be about 1000 times the text.
    assert stream._parsed_chars < 2 * len(text)


def test_open_call_is_reread_from_its_marker_only() -> None:
    # Long content, then a call streamed in small pieces: each piece re-reads
    # the call so far, never the content before it.
    head = "word " * 2000
    stream = ChatOutputStream("hermes")
    stream.feed(head)
    before = stream._parsed_chars
    for k in range(0, len(CALL), 2):
        stream.feed(CALL[k : k + 2])
    assert stream._parsed_chars - before < len(CALL) ** 2
    assert stream.finish().tool_calls[0].name == "get_weather"


# --- work: parse_chat_output with a marker repeated ----------------------------------


@contextmanager
def _counting_lines() -> Iterator[list[int]]:
    """Count the Python lines the chat package runs (a measure of work, not
    time)."""
    count = [0]
    source = os.path.dirname(chat.__file__)

    def local(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            count[0] += 1
        return local

    def trace(frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        return local if os.path.dirname(frame.f_code.co_filename) == source else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield count
    finally:
        sys.settrace(previous)


class _CountingText(str):
    """A text that counts the characters its ``find`` searches through."""

    searched = 0

    def find(self, sub: str, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        at = super().find(sub, start, end)
        first = 0 if start is None else start
        last = len(self) if end is None else min(end, len(self))
        self.searched += max(0, (at + len(sub) if at >= 0 else last) - first)
        return at


def _work(text: str, fmt: str, partial: bool) -> int:
    """Python lines run plus characters searched through by ``find``."""
    counted = _CountingText(text)
    with _counting_lines() as lines:
        parse_chat_output(counted, format=fmt, partial=partial)
    return lines[0] + counted.searched


REPEATED = [
    ("[TOOL_CALLS]oops! ", ""),  # a marker that is not the first one looked for
    ("<tool_call> x ", ""),
    ("<|python_tag|>!! ", ""),
    ("```tool_code! ", ""),
    ("```tool_code\nf(", ""),  # brackets that never close
    ("<|python_tag|>f(", ""),
    (DS_CALL + "x ", ""),  # no separator
    (DS_CALL + "x y ", DS_SEP),  # a separator far ahead
    (DS_CALL + "function" + DS_SEP + "name ", ""),  # no newline
]


@pytest.mark.parametrize(("unit", "end"), REPEATED)
@pytest.mark.parametrize("partial", [False, True])
def test_repeated_markers_cost_linear_work(unit: str, end: str, partial: bool) -> None:
    small, large = (_work(unit * n + end, "auto", partial) for n in (200, 800))
    # Four times the text, about four times the work (a pass over the rest
    # of the text per marker would make it sixteen).
    assert large < 5 * small, (small, large)
