"""OpenAI's Responses API (``/v1/responses``) on the chat pipeline: one
more reader of requests and writer of replies, not a second pipeline.

A request's ``instructions`` and ``input`` (a string, or items: messages,
``function_call``, ``function_call_output``; images as ``input_image``
data URLs) become chat messages; ``tools`` (functions), ``tool_choice``,
``text.format`` (``json_schema``, ``json_object``), ``max_output_tokens``,
``temperature`` / ``top_p`` and ``reasoning.effort`` become the chat
request's. The reply's typed deltas are written as Responses items
(``reasoning``, ``message``, ``function_call``) and, streamed, as its
events in order. With ``store`` (OpenAI's default: true) a response is
kept in a bounded in-memory store (:class:`ResponseStore`: the newest
:data:`STORE_ENTRIES`, at most :data:`STORE_BYTES` in all; a restart
forgets them) for ``previous_response_id``, ``GET`` and ``DELETE``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal.server._chat import (
    ChatChoice,
    Reply,
    chat_events,
    chat_prompt,
    collect,
    prepare,
    prompt_tokens,
)
from lloyal.server._engine import ChoiceEvent
from lloyal.server._http import event_stream, primed, read_body, until_disconnect
from lloyal.server._models import Models
from lloyal.server._protocol import (
    ApiError,
    ChatRequest,
    RequestOptions,
    checked_messages,
    checked_tools,
    flag_field,
    integer_field,
    sampling,
    tool_choice,
)
from lloyal.server._response_items import ItemIds, ResponseStream, output_items, sse
from lloyal.server._state import State

STORE_ENTRIES = 1024
"""The most responses the store keeps (the oldest go first)."""

STORE_BYTES = 64 << 20
"""The most bytes (their JSON) the store keeps in all."""

# reasoning.effort as a reasoning budget (tokens before the end of
# thinking is forced; -1: no limit).
EFFORT_BUDGETS = {"minimal": 0, "low": 512, "medium": 2048, "high": -1}


@dataclass
class Stored:
    """A stored response and the conversation it ends (chat messages:
    the input and the reply, without ``instructions``), for
    ``previous_response_id``."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    size: int = 0


@dataclass
class ResponseStore:
    """Responses by id, newest last; bounded by :data:`STORE_ENTRIES` and
    :data:`STORE_BYTES`."""

    entries: int = STORE_ENTRIES
    limit: int = STORE_BYTES
    _items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, stored: Stored) -> None:
        stored.size = len(json.dumps(stored.response)) + len(json.dumps(stored.messages))
        rid = stored.response["id"]
        self.delete(rid)
        self._items[rid] = stored
        self._bytes += stored.size
        while self._items and (len(self._items) > self.entries or self._bytes > self.limit):
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size

    def get(self, rid: str) -> Stored:
        stored = self._items.get(rid)
        if stored is None:
            raise ApiError(f"no stored response {rid!r}", status=404, param="response_id")
        self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        stored = self._items.pop(rid, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored is not None


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    # The conversation without instructions (what a stored response keeps).
    conversation: list[dict[str, Any]]
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool
    previous: str | None


def _bad(message: str, param: str = "input") -> ApiError:
    return ApiError(message, param=param)


def _text_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or parts (text, and images as data
    URLs) in the chat layer's form."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise _bad(f"{where}[{j}] needs its text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _bad(f"{where}[{j}]: images are image_url data URLs (nothing is fetched)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _bad(f"{where}[{j}]: content parts are input_text or input_image, got {kind!r}")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is a user message; items are
    messages, ``function_call`` (consecutive ones, one assistant turn) and
    ``function_call_output`` (a tool message); ``reasoning`` items are not
    shown to the model again."""
    if isinstance(value, str):
        if not value:
            raise _bad("input must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for j, item in enumerate(value):
        where = f"input[{j}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be user, assistant, system or developer")
            content = _text_parts(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise _bad(f"{where}: a function_call needs call_id, name and arguments (strings)")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a function_call_output needs its call_id")
            text = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise _bad(
                f"{where}.type must be message, function_call, function_call_output or "
                f"reasoning, got {kind!r}"
            )
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    """Function tools (flat, as the Responses API writes them) and the
    tool choice, in the chat layer's form."""
    tools = body.get("tools")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError("tools must be a list", param="tools")
        chat_tools = []
        for j, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise ApiError(
                    f"tools[{j}]: only function tools are served, got {kind!r}", param="tools"
                )
            fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
            chat_tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return checked_tools(chat_tools), tool_choice(choice, checked_tools(chat_tools))


def _format(body: dict[str, Any]) -> dict[str, Any] | bool | None:
    """``text.format``'s JSON schema (``json_object``: any object)."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else ...
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("text.format.type must be text, json_object or json_schema", param="text")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "object"}
    schema = fmt.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ApiError("text.format.schema must be a JSON schema", param="text")
    return schema


def responses_request(raw: object, store: ResponseStore, *, vocab_size: int) -> ResponsesRequest:
    if not isinstance(raw, dict):
        raise ApiError("the body must be a JSON object")
    body: dict[str, Any] = raw
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise ApiError("previous_response_id must be a string", param="previous_response_id")
    history = [dict(m) for m in store.get(previous).messages] if previous else []
    conversation = history + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError("instructions must be a string", param="instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools, choice = _tools(body)
    effort = None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        effort = reasoning["effort"]
        if effort not in EFFORT_BUDGETS:
            raise ApiError(
                "reasoning.effort must be minimal, low, medium or high", param="reasoning"
            )
    params, seed = sampling({k: body[k] for k in ("temperature", "top_p") if k in body}, vocab_size)
    options = RequestOptions(
        n=1,
        max_tokens=integer_field(body, "max_output_tokens", None, 1, 1 << 20),
        params=params,
        seed=seed,
        stop=(),
        stream=flag_field(body, "stream", False),
        include_usage=False,
        logprobs=None,
        reasoning_budget=EFFORT_BUDGETS[effort] if effort else None,
    )
    chat = ChatRequest(
        messages=checked_messages([*system, *[dict(m) for m in conversation]]),
        generation=options,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=flag_field(body, "parallel_tool_calls", True),
        json_schema=_format(body),
        reasoning_effort=effort,
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": options.max_tokens,
        "parallel_tool_calls": chat.parallel_tool_calls,
        "previous_response_id": previous,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": {"effort": effort, "summary": None},
        "metadata": body.get("metadata") or {},
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesRequest(chat, conversation, echo, flag_field(body, "store", True), previous)


def _reply_message(reply: Reply) -> dict[str, Any]:
    """The reply as a chat message, for the conversation a store keeps."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.calls
        ]
    return message


def _response(
    ids: ItemIds,
    req: ResponsesRequest,
    state: State,
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": state.name,
        "output": output,
        "usage": usage,
        "store": req.store,
        **req.echo,
    }


# -- the routes ------------------------------------------------------------------------


def _store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


async def create(request: Request, state: State) -> Response:
    """``POST /v1/responses``."""
    store = _store(request)
    req = responses_request(await read_body(request), store, vocab_size=state.ctx.vocab_size)
    gen = req.chat.generation
    prompt, grammar, tokens = await prepare(state, req.chat)
    ids, created = ItemIds(), int(time.time())
    choice = ChatChoice(prompt)
    cached = 0

    def usage() -> dict[str, Any]:
        return {
            "input_tokens": len(tokens),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": choice.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(tokens) + choice.tokens,
        }

    async def events() -> AsyncGenerator[ChoiceEvent, None]:
        nonlocal cached
        async for event in chat_events(state, tokens, gen, prompt, grammar):
            cached = event.cached if event.cached is not None else cached
            if event.token is not None:
                choice.tokens += 1
            yield event

    def finished(reply: Reply) -> dict[str, Any]:
        status = "incomplete" if reply.finish == "length" else "completed"
        body = _response(
            ids, req, state, created, status=status, output=output_items(ids, reply), usage=usage()
        )
        if req.store:
            store.put(Stored(body, [*req.conversation, _reply_message(reply)]))
        return body

    if gen.stream:
        source = await primed(events(), request)
        start = _response(ids, req, state, created, status="in_progress", output=[], usage=None)
        return event_stream(
            state,
            source,
            ResponseStream(ids, choice).events(source, start, finished),
            encode=sse,
            done=None,
        )

    async def whole() -> Response:
        finish, _ = await collect(choice, events())
        return JSONResponse(finished(choice.final(finish)))

    return await until_disconnect(request, whole())


async def input_tokens(request: Request, state: State) -> Response:
    """``POST /v1/responses/input_tokens``: the tokens a request's input
    would decode."""
    req = responses_request(
        await read_body(request), _store(request), vocab_size=state.ctx.vocab_size
    )
    prompt = chat_prompt(state.ctx, state.config.template, req.chat)
    count = len(await prompt_tokens(state.ctx, prompt))
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


async def get_response(request: Request, models: Models) -> Response:
    """``GET /v1/responses/{id}``."""
    return JSONResponse(_store(request).get(request.path_params["response_id"]).response)


async def delete_response(request: Request, models: Models) -> Response:
    """``DELETE /v1/responses/{id}``."""
    rid = request.path_params["response_id"]
    if not _store(request).delete(rid):
        raise ApiError(f"no stored response {rid!r}", status=404, param="response_id")
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
