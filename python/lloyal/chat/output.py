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
``qwen3-coder`` ``<tool_call><function=NAME><parameter=KEY>value</parameter>``
             ``...</function></tool_call>`` (values as text: see below)
``glm-4.5``  ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value``
             ``</arg_value>...</tool_call>``
``kimi-k2``  ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0``
             ``<|tool_call_argument_begin|>{...}<|tool_call_end|>...`` (the
             ``functions.NAME:0`` is the call's id)
``granite``  ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``
``command-r`` ``<|START_ACTION|>[{"tool_call_id": ..., "tool_name": ...,``
             ``"parameters": {...}}]<|END_ACTION|>``; reasoning in
             ``<|START_THINKING|>...<|END_THINKING|>``, the answer in
             ``<|START_RESPONSE|>...<|END_RESPONSE|>``
``gpt-oss``  harmony: reasoning in the ``analysis`` channel, calls addressed
             ``to=functions.NAME`` with a JSON ``<|message|>``, the answer in
             the ``final`` channel (channel headers are not content)
``content``  no tool calls (reasoning is still split off)
``auto``     every marker above except ````` ```json ````` and the
             reasoning and structure markers of command-r and gpt-oss, and a
             reply that starts with a generic or llama3 JSON object
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
  with it, and so is anything that may be the start of a marker). In the
  ``content`` format (no calls: a chat request without tools) only leading
  whitespace is stripped: the text is the model's as written, as OpenAI's
  and llama-server's replies are, and a stream sends a blank token at once
  instead of holding it until the next word.
- Reasoning is only recognised at the start of the reply (or, with
  ``thinking_started=True``, when the prompt already opened ``<think>``);
  one newline after ``<think>`` and one before ``</think>`` are dropped. A
  ``<think>`` that is never closed makes the rest of the reply reasoning.
- A call's ``arguments`` is the JSON text exactly as the model wrote it;
  a call written without arguments gets ``"{}"``. Calls in Python syntax
  (``tool_code``, ``<|python_tag|>``) get ``json.dumps`` of their keyword
  arguments and show only once their closing parenthesis arrives.
- Calls written as tags (qwen3-coder, glm-4.5) get a JSON object of their
  parameters: a value that parses as JSON and is not a string (``42``,
  ``true``, ``[1]``, ``{...}``) is that JSON, anything else a string;
  while such a call streams, its arguments are the complete parameters so
  far, without the closing brace.
- A bare JSON object counts as a call only when its first key is one a
  call object starts with (``name``, ``type``, ``function``, ``arguments``,
  ``parameters``, ``id``) and it has both a name and arguments.
- A final reply whose call is cut off or broken keeps that text, marker
  included, in the content; calls before it are kept. A call whose JSON is
  complete counts even when its closing tag never came.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lloyal.chat._blocks import _bare, _Spec
from lloyal.chat._families import FAMILIES
from lloyal.chat._scan import _WS, _held_from, _Memo, _pending, _skip
from lloyal.chat._types import CHAT_FORMATS, ChatOutput, ToolCall

__all__ = ["CHAT_FORMATS", "ChatOutput", "ChatOutputStream", "ToolCall", "parse_chat_output"]


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
    family = FAMILIES.get(format) if isinstance(format, str) else None
    spec = family.parser if family is not None else None
    if spec is None:
        raise ValueError(f"unknown chat format {format!r}; expected one of {CHAT_FORMATS}")
    try:
        return _parse(text, spec, partial=bool(partial), thinking_started=bool(thinking_started))
    except Exception:  # pragma: no cover - a bug here must not break the caller's stream
        return ChatOutput(content=text.strip())


def _split_reasoning(
    text: str, partial: bool, thinking_started: bool, think: tuple[str, str]
) -> tuple[str, str]:
    """(reasoning, the rest of the reply)."""
    opener, closer = think
    if thinking_started:
        start = 0
    else:
        s = _skip(text, 0)
        if not text.startswith(opener, s):
            if partial and s < len(text) and _pending(text, s, opener):
                return "", ""
            return "", text
        start = s + len(opener)
    close = text.find(closer, start)
    if close >= 0:
        reasoning, rest = text[start:close], text[close + len(closer) :]
    else:
        end = _held_from(text, start, (closer,)) if partial else len(text)
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
    reasoning, body = _split_reasoning(text, partial, thinking_started, spec.think)
    parsed = _parse_body(body, spec, partial, at_start=True)
    return _output(parsed.pieces, reasoning, parsed.calls, spec)


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


def _output(pieces: list[str], reasoning: str, calls: list[ToolCall], spec: _Spec) -> ChatOutput:
    return ChatOutput(_trim("".join(pieces), spec), reasoning, tuple(calls))


def _trim(content: str, spec: _Spec) -> str:
    """The content without its surrounding whitespace, or, in a format with
    no calls (``content``), only without its leading whitespace: there the
    text is the model's as written, and a stream need not hold back a
    blank token until the next word."""
    if spec.blocks or spec.generic or spec.llama:
        return content.strip()
    return content.lstrip()


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
        family = FAMILIES.get(format) if isinstance(format, str) else None
        spec = family.parser if family is not None else None
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
        opener, closer = self._spec.think
        if self._phase == "head":
            head = (self._head + piece).lstrip(_WS)
            self._parsed_chars += len(head)
            if head.startswith(opener):
                self._phase, self._head = "think", ""
                piece = head[len(opener) :]
            elif not head or _pending(head, 0, opener):
                self._head = head
                return ChatOutput("")
            else:
                self._phase, self._head = "body", ""
                piece = head
        if self._phase == "think":
            seen = len(self._thought)
            thought = self._thought + piece
            close = thought.find(closer, max(0, seen - len(closer) + 1))
            self._parsed_chars += len(piece) + len(closer) - 1
            if close < 0:
                self._thought = thought
                held = _held_from(thought, 0, (closer,))
                return ChatOutput("", _trim_reasoning(thought[:held]))
            self._phase, self._thought = "body", ""
            self._reasoning = _trim_reasoning(thought[:close])
            piece = thought[close + len(closer) :]
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
            _trim(self._content + "".join(pieces), self._spec),
            self._reasoning,
            (*self._calls, *calls),
        )

    def _finish(self) -> ChatOutput:
        if self._phase == "head":
            return _parse(self._head, self._spec, partial=False, thinking_started=False)
        if self._phase == "think":
            return ChatOutput("", _trim_reasoning(self._thought))
        body = _parse_body(self._tail, self._spec, False, self._at_start)
        return ChatOutput(
            _trim(self._content + "".join(body.pieces), self._spec),
            self._reasoning,
            (*self._calls, *body.calls),
        )
