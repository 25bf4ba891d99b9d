"""Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``) over the same engine as the OpenAI routes.

A request is parsed into the server's one chat request (``ChatRequest``):
the system prompt is a system message; ``tool_use`` blocks become the
assistant's tool calls; each ``tool_result`` becomes a ``tool`` message;
base64 images become image parts; ``tools`` with ``input_schema``,
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), ``stop_sequences``,
``thinking`` (its ``budget_tokens`` as the reasoning budget). It then goes
through the same checks, template, grammar and step loop as every chat
request. The reply's typed deltas are written as content blocks
(``thinking``, ``text``, ``tool_use``), streamed with Anthropic's events.
Errors use Anthropic's body:
``{"type": "error", "error": {"type": ..., "message": ...}}``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal.server._chat import (
    CallArguments,
    CallStart,
    ChatChoice,
    Delta,
    ReasoningDelta,
    Reply,
    TextDelta,
    chat_events,
    chat_prompt,
    collect,
    prepare,
    prompt_tokens,
)
from lloyal.server._engine import ChoiceEvent
from lloyal.server._http import event_stream, primed, sse_json, until_disconnect
from lloyal.server._protocol import (
    ApiError,
    ChatRequest,
    RequestOptions,
    checked_messages,
    checked_tools,
    flag_field,
    integer_field,
    parse_json,
    sampling,
    stop_strings,
    tool_choice,
)
from lloyal.server._state import State

# Anthropic documents no limit of 4 (OpenAI's); clients send more. Each is
# matched on every token, so there is one, generous.
MAX_STOP_SEQUENCES = 64

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error body for ``e``."""
    kind = _ERROR_TYPES.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _sse(body: dict[str, Any]) -> bytes:
    """An Anthropic event: its type on an ``event:`` line, then the data."""
    return f"event: {body['type']}\ndata: {sse_json(body)}\n\n".encode()


def _bad(message: str) -> ApiError:
    return ApiError(message, param="messages")


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for block in content:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _bad(f"{where}: only text blocks are taken here")
            if not isinstance(block.get("text"), str):
                raise _bad(f"{where}: a text block needs a string text")
            texts.append(block["text"])
        return "".join(texts)
    raise _bad(f"{where} must be a string or a list of text blocks")


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        raise _bad(f"{where}: images must be base64 sources (nothing is fetched)")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise _bad(f"{where}: a base64 source needs media_type and data")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _document(block: dict[str, Any], where: str) -> str:
    """A ``document`` block's text (a plain-text source, or text blocks),
    under its title. Nothing is fetched, and PDFs are not read here."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        text: str = source["data"]
    elif kind == "content" and isinstance(source, dict):
        text = _text_of(source.get("content"), f"{where}.source")
    elif kind == "base64" and isinstance(source, dict) and source.get("media_type") == "text/plain":
        try:
            text = base64.b64decode(str(source.get("data", "")), validate=True).decode()
        except ValueError:
            raise _bad(f"{where}: the document's data is not base64 UTF-8 text") from None
    elif kind == "base64":
        media = source.get("media_type") if isinstance(source, dict) else None
        raise _bad(f"{where}: only plain-text documents are read here, not {media!r}")
    else:
        raise _bad(
            f"{where}: a document needs a text, content or base64 source (nothing is fetched)"
        )
    title = block.get("title")
    return f"{title}\n\n{text}" if isinstance(title, str) and title else text


def _result(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A ``tool_result``'s content: its text, or parts when it holds
    images."""
    if not isinstance(content, list) or not any(
        isinstance(b, dict) and b.get("type") == "image" for b in content
    ):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append(_image_part(block, at))
        else:
            parts.append({"type": "text", "text": _text_of([block], at)})
    return parts


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages first, then
    the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "document":
            parts.append({"type": "text", "text": _document(block, at)})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{at}: a tool_result needs its tool_use_id")
            result = _result(block.get("content", ""), at)
            if block.get("is_error"):
                result = (
                    f"Error: {result}"
                    if isinstance(result, str)
                    else [{"type": "text", "text": "Error: "}, *result]
                )
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        else:
            raise _bad(f"{at}: user blocks are text, image, document or tool_result, got {kind!r}")
    if parts:
        text_only = all(p["type"] == "text" for p in parts)
        body = "".join(p["text"] for p in parts) if text_only else parts
        out.append({"role": "user", "content": body})
    return out


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of blocks")
    text, calls = [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _bad(f"{at}: a tool_use needs an id and a name")
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            call = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": call})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning is not shown to the model again
        else:
            raise _bad(f"{at}: assistant blocks are text, tool_use or thinking, got {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """``tools``, ``tool_choice`` and whether calls may be parallel, in the
    chat layer's form."""
    functions = None
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError("tools must be a list", param="tools")
        functions = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise ApiError(f"tools[{i}] needs a name", param="tools")
            if t.get("type") not in (None, "custom"):
                raise ApiError(
                    f"tools[{i}]: server tools ({t['type']}) are not run here", param="tools"
                )
            fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object"})}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            functions.append({"type": "function", "function": fn})
    checked = checked_tools(functions)
    choice = body.get("tool_choice")
    value: Any = "auto"
    parallel = True
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (
            "auto",
            "any",
            "tool",
            "none",
        ):
            raise ApiError("tool_choice.type must be auto, any, tool or none", param="tool_choice")
        kind = choice["type"]
        if kind == "tool":
            value = {"type": "function", "function": {"name": choice.get("name")}}
        else:
            value = {"auto": "auto", "any": "required", "none": "none"}[kind]
        parallel = not choice.get("disable_parallel_tool_use")
    return checked, tool_choice(value, checked), parallel


def messages_request(raw: object, *, vocab_size: int, need_max_tokens: bool = True) -> ChatRequest:
    """An Anthropic Messages request as the server's chat request."""
    if not isinstance(raw, dict):
        raise ApiError("the body must be a JSON object")
    body: dict[str, Any] = raw
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where}.role must be user or assistant")
        if m["role"] == "user":
            chat += _user(m.get("content"), where)
        else:
            chat.append(_assistant(m.get("content"), where))
    tools, choice, parallel = _tools(body)
    max_tokens = integer_field(body, "max_tokens", None, 1, 1 << 20)
    if need_max_tokens and max_tokens is None:
        raise ApiError("max_tokens is required", param="max_tokens")
    # Anthropic's sampling fields (the rest keep the server's defaults).
    params, _ = sampling(
        {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}, vocab_size
    )
    budget = None
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = integer_field(thinking, "budget_tokens", None, -1, 1 << 20)
    options = RequestOptions(
        n=1,
        max_tokens=max_tokens,
        params=params,
        seed=None,
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences", most=MAX_STOP_SEQUENCES),
        stream=flag_field(body, "stream", False),
        include_usage=False,
        logprobs=None,
        reasoning_budget=budget,
    )
    return ChatRequest(
        messages=checked_messages(chat),
        generation=options,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        json_schema=_output_format(body),
    )


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of ``output_config.format`` (structured outputs: what
    the SDK's ``messages.parse(output_format=...)`` sends), or None."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ApiError("output_config must be an object", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise ApiError(
            'output_config.format must be {"type": "json_schema", "schema": {...}}',
            param="output_config",
        )
    schema: dict[str, Any] = fmt["schema"]
    return schema


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(finish: str, stop: str | None) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` for a finish (``stop``: the
    stop string that ended the reply, if one did)."""
    if finish == "stop" and stop is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop}
    return {"stop_reason": _STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}


def _input(arguments: str) -> Any:
    """A call's ``input``. Arguments that ``max_tokens`` cut off are read
    as the SDKs read a stream's partial JSON (jiter's partial mode), so a
    reply says the same streamed or not."""
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        pass
    from jiter import from_json

    try:
        return from_json(arguments.encode(), partial_mode=True)
    except ValueError:
        return {}


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    """A finished reply as content blocks."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
        )
    return blocks


async def count_tokens(request: Request, state: State) -> Response:
    """``{"input_tokens": n}``: the prompt a Messages request would decode."""
    raw = parse_json(await request.body())
    req = messages_request(raw, vocab_size=state.ctx.vocab_size, need_max_tokens=False)
    prompt = chat_prompt(state.ctx, state.config.template, req)
    return JSONResponse({"input_tokens": len(await prompt_tokens(state.ctx, prompt))})


async def messages(request: Request, state: State) -> Response:
    req = messages_request(parse_json(await request.body()), vocab_size=state.ctx.vocab_size)
    gen = req.generation
    prompt, grammar, tokens = await prepare(state, req)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    choice = ChatChoice(prompt)
    cached = 0

    def usage() -> dict[str, int]:
        # Anthropic counts the prompt tokens read from a cache apart.
        return {
            "input_tokens": len(tokens) - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": choice.tokens,
        }

    async def events() -> AsyncGenerator[ChoiceEvent, None]:
        nonlocal cached
        async for event in chat_events(state, tokens, gen, prompt, grammar):
            cached = event.cached if event.cached is not None else cached
            if event.token is not None:
                choice.tokens += 1
            yield event

    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.name}
    if gen.stream:
        source = await primed(events(), request)
        return event_stream(
            state,
            source,
            _stream(head, source, choice, usage),
            encode=_sse,
            done=None,
            error_body=error_body,
        )

    async def whole() -> Response:
        finish, stop = await collect(choice, events())
        reply = choice.final(finish)
        return JSONResponse(
            {
                **head,
                "content": _blocks(reply),
                **_stop_reason(reply.finish, stop),
                "usage": usage(),
            }
        )

    return await until_disconnect(request, whole())


async def _stream(
    head: dict[str, Any], source: Any, choice: ChatChoice, usage: Any
) -> AsyncGenerator[dict[str, Any], None]:
    """Anthropic's events for one reply: ``message_start``, each content
    block's ``start`` / ``delta`` / ``stop``, ``message_delta`` with the stop
    reason, ``message_stop``."""
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
    yield {"type": "message_start", "message": {**start, "usage": {**usage(), "output_tokens": 0}}}
    yield {"type": "ping"}
    blocks = _Blocks()
    finish, stop = "stop", None
    async for event in source:
        if event.finish is not None:
            for out in blocks.feed(choice.closing(event.finish)):
                yield out
            finish = choice.final(event.finish).finish
            stop = event.stop
        else:
            for out in blocks.feed(choice.delta(event.text)):
                yield out
    for out in blocks.close():
        yield out
    yield {
        "type": "message_delta",
        "delta": _stop_reason(finish, stop),
        "usage": {"output_tokens": usage()["output_tokens"]},
    }
    yield {"type": "message_stop"}


class _Blocks:
    """A reply's typed deltas as Anthropic's content block events: one
    block open at a time, a new one when the kind changes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or a call's key
        self.calls = 0
        self._started: dict[int, CallStart] = {}

    def _start(self, key: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = key
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if self.open != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            elif isinstance(d, TextDelta):
                if self.open != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, CallStart):
                self._started[d.index] = d
                out += self._call(d, d.arguments)
            elif isinstance(d, CallArguments):
                out += self._call(self._started[d.index], d.arguments)
        return out

    def _call(self, call: CallStart, arguments: str) -> list[dict[str, Any]]:
        """More of a call: in its open block, or a new block for it (the
        call's arguments resumed after other text)."""
        out: list[dict[str, Any]] = []
        if self.open != f"call{call.index}":
            self.calls += 1
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
            out += self._start(f"call{call.index}", block)
        if arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]
