"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``,
``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/version``) on the chat
pipeline: what editor plugins, desktop apps and scripts that speak only
Ollama's API send, in its shapes.

A chat's ``messages`` (``images`` as base64, ``tool_calls`` with object
arguments, ``tool`` results), ``tools``, ``format`` (``"json"`` or a JSON
schema), ``options`` (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, ``num_predict``, ``stop``, ``presence_penalty``,
``frequency_penalty``; Ollama's other options are accepted and have no
effect here, as Ollama ignores the ones a runner lacks) and ``think``
become the chat request's (and ``tool_choice``, as OpenAI's: lloyal's
extension, since Ollama cannot force a call); replies stream as NDJSON (Ollama's default:
``stream`` is true unless false), each line a ``message`` piece, the last
with ``done: true``, ``done_reason`` and the counts. ``keep_alive`` ``0``
closes the model once the request is answered (as Ollama unloads it);
other durations are checked and the server's ``--keep-alive`` applies.
Errors are Ollama's ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncGenerator
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal import __version__
from lloyal.server._chat import (
    ChatChoice,
    ReasoningDelta,
    Reply,
    TextDelta,
    chat_events,
    collect,
    prepare,
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
    json_object,
    sampling,
    stop_strings,
    tool_choice,
)
from lloyal.server._state import State

# The version /api/version reports: clients check it against features.
OLLAMA_VERSION = "0.12.0"


def error_body(e: ApiError) -> dict[str, Any]:
    """Ollama's error body."""
    return {"error": e.message}


def _ndjson(body: dict[str, Any]) -> bytes:
    return (json.dumps(body) + "\n").encode()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# -- requests ---------------------------------------------------------------------------


_OPTIONS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty"}
_OPTIONS |= {"frequency_penalty"}


def _options(body: dict[str, Any], vocab_size: int, stream: bool) -> RequestOptions:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError("options must be an object", param="options")
    params, seed = sampling({k: v for k, v in options.items() if k in _OPTIONS}, vocab_size)
    most = options.get("num_predict")
    if most is not None and (not isinstance(most, int) or isinstance(most, bool) or most == 0):
        raise ApiError("options.num_predict must be a whole number, not 0", param="options")
    stop = options.get("stop")
    return RequestOptions(
        n=1,
        max_tokens=most if most is not None and most > 0 else None,
        params=params,
        seed=seed,
        stop=stop_strings(stop, "options.stop", most=64),
        stream=stream,
        include_usage=False,
        logprobs=None,
    )


def _format(body: dict[str, Any]) -> dict[str, Any] | bool | None:
    fmt = body.get("format")
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "object"}
    if isinstance(fmt, (dict, bool)):
        return fmt
    raise ApiError('format must be "json" or a JSON schema', param="format")


def _image(data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, str):
        raise ApiError(f"{where}: images are base64 strings", param="messages")
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def _messages(raw: object) -> list[dict[str, Any]]:
    """Ollama's messages in the chat layer's form."""
    if not isinstance(raw, list) or not raw:
        raise ApiError("messages must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object", param="messages")
        message: dict[str, Any] = {"role": m.get("role"), "content": m.get("content", "")}
        images = m.get("images")
        if images:
            if not isinstance(images, list):
                raise ApiError(f"{where}.images must be a list", param="messages")
            text = message["content"] if isinstance(message["content"], str) else ""
            parts = [{"type": "text", "text": text}] if text else []
            message["content"] = parts + [_image(x, where) for x in images]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ApiError(f"{where}.tool_calls must be a list", param="messages")
            message["tool_calls"] = [
                _call_in(c, f"{where}.tool_calls[{j}]", j) for j, c in enumerate(calls)
            ]
        if isinstance(m.get("tool_name"), str):
            message["name"] = m["tool_name"]
        out.append(message)
    return checked_messages(out)


def _call_in(call: object, where: str, j: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} needs a function with a name", param="messages")
    arguments = fn.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        raise ApiError(f"{where}.function.arguments must be an object", param="messages")
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {
        "id": f"call_{j}",
        "type": "function",
        "function": {"name": fn["name"], "arguments": text},
    }


def _think(body: dict[str, Any]) -> bool | None:
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return think
    if think in ("low", "medium", "high"):  # GPT-OSS's levels: thinking on
        return True
    raise ApiError('think must be true, false, "low", "medium" or "high"', param="think")


def _keep_alive(body: dict[str, Any]) -> float | None:
    """``keep_alive`` in seconds (a number, or a duration such as "5m")."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        match = re.fullmatch(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)?", value.strip())
        if match:
            unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[match.group(2)]
            return float(match.group(1)) * unit
    raise ApiError(
        'keep_alive must be a number of seconds or a duration ("5m")', param="keep_alive"
    )


def chat_request(raw: object, vocab_size: int) -> tuple[ChatRequest, float | None]:
    body = json_object(raw)
    tools = checked_tools(body.get("tools") or None)
    chat = ChatRequest(
        messages=_messages(body.get("messages")),
        generation=_options(body, vocab_size, flag_field(body, "stream", True)),
        tools=tools,
        # lloyal's extension (Ollama has none): OpenAI's tool_choice.
        tool_choice=tool_choice(body.get("tool_choice"), tools),
        json_schema=_format(body),
        enable_thinking=_think(body),
    )
    return chat, _keep_alive(body)


def generate_request(raw: object, vocab_size: int) -> tuple[ChatRequest, float | None]:
    """``/api/generate`` as a one-turn chat (``system`` and ``prompt``)."""
    body = json_object(raw)
    prompt = body.get("prompt", "")
    system = body.get("system")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError("prompt must be a non-empty string", param="prompt")
    if system is not None and not isinstance(system, str):
        raise ApiError("system must be a string", param="system")
    if body.get("raw") or body.get("suffix") or body.get("template"):
        raise ApiError(
            "raw, suffix and template are not served here: use /v1/completions or /infill",
            param="prompt",
        )
    user: dict[str, Any] = {"role": "user", "content": prompt}
    if body.get("images"):
        user["images"] = body["images"]
    messages = ([{"role": "system", "content": system}] if system else []) + [user]
    chat = ChatRequest(
        messages=_messages(messages),
        generation=_options(body, vocab_size, flag_field(body, "stream", True)),
        json_schema=_format(body),
        enable_thinking=_think(body),
    )
    return chat, _keep_alive(body)


# -- replies ---------------------------------------------------------------------------


def _calls_out(reply: Reply) -> list[dict[str, Any]]:
    out = []
    for c in reply.calls:
        try:
            arguments = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            arguments = {}
        out.append({"function": {"name": c.name, "arguments": arguments}})
    return out


async def _run(
    request: Request, state: State, req: ChatRequest, keep_alive: float | None, *, chat: bool
) -> Response:
    """One reply in Ollama's shapes: a chat's ``message`` or a generation's
    ``response``, streamed as NDJSON or whole."""
    gen = req.generation
    started = time.monotonic_ns()
    prompt, grammar, tokens = await prepare(state, req)
    choice = ChatChoice(prompt)
    if keep_alive == 0:
        models: Models = request.app.state.lloyal
        body = await read_body(request)
        models.close_when_idle(body.get("model") if isinstance(body, dict) else None)

    def counts(reason: str) -> dict[str, Any]:
        total = time.monotonic_ns() - started
        return {
            "done": True,
            "done_reason": reason,
            "total_duration": total,
            "load_duration": 0,
            "prompt_eval_count": len(tokens),
            "prompt_eval_duration": 0,
            "eval_count": choice.tokens,
            "eval_duration": total,
        }

    def piece(content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        head = {"model": state.name, "created_at": _now()}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {**head, "message": message}
        return {**head, "response": content, **({"thinking": thinking} if thinking else {})}

    async def events() -> AsyncGenerator[ChoiceEvent, None]:
        async for event in chat_events(state, tokens, gen, prompt, grammar):
            if event.token is not None:
                choice.tokens += 1
            yield event

    def reason(finish: str) -> str:
        return "length" if finish == "length" else "stop"

    if gen.stream:
        source = await primed(events(), request)

        async def lines() -> AsyncGenerator[dict[str, Any], None]:
            finish = "stop"
            async for event in source:
                if event.finish is not None:
                    finish = event.finish
                    continue
                deltas = choice.delta(event.text)
                text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
                thought = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
                if text or thought:
                    yield {**piece(text, thought, []), "done": False}
            reply = choice.final(finish)
            # Calls go whole in the last line (Ollama streams a call once,
            # complete), with what the parse held back.
            seen = choice.seen
            tail = (
                reply.content[len(seen.content) :] if reply.content.startswith(seen.content) else ""
            )
            yield {**piece(tail, "", _calls_out(reply)), **counts(reason(reply.finish))}

        return event_stream(
            state,
            source,
            lines(),
            encode=_ndjson,
            done=None,
            error_body=error_body,
            media_type="application/x-ndjson",
        )

    async def whole() -> Response:
        finish, _ = await collect(choice, events())
        reply = choice.final(finish)
        body = piece(reply.content, reply.reasoning, _calls_out(reply))
        return JSONResponse({**body, **counts(reason(reply.finish))})

    return await until_disconnect(request, whole())


async def chat(request: Request, state: State) -> Response:
    """``POST /api/chat``."""
    req, keep_alive = chat_request(await read_body(request), state.ctx.vocab_size)
    return await _run(request, state, req, keep_alive, chat=True)


async def generate(request: Request, state: State) -> Response:
    """``POST /api/generate``."""
    req, keep_alive = generate_request(await read_body(request), state.ctx.vocab_size)
    return await _run(request, state, req, keep_alive, chat=False)


async def embed(request: Request, state: State) -> Response:
    """``POST /api/embed``: ``{"input": str | [str]}`` ->
    ``{"embeddings": [[...]]}``."""
    body = json_object(await read_body(request))
    value = body.get("input")
    inputs = [value] if isinstance(value, str) else value
    if (
        not isinstance(inputs, list)
        or not inputs
        or not all(isinstance(t, str) and t for t in inputs)
    ):
        raise ApiError("input must be a non-empty string or list of them", param="input")
    if not state.config.embeddings or state.reranker:
        raise ApiError("this model makes no embeddings here", status=404, param="model")
    started = time.monotonic_ns()
    ctx = await state.embedder()
    tokens = [await ctx.tokenize(t) for t in inputs]
    if max(len(t) for t in tokens) > ctx.n_batch:
        raise ApiError(f"each input may have at most {ctx.n_batch} tokens", param="input")
    rows = await ctx.embed_tokens(tokens)
    return JSONResponse(
        {
            "model": state.name,
            "embeddings": [row.tolist() for row in rows],
            "total_duration": time.monotonic_ns() - started,
            "load_duration": 0,
            "prompt_eval_count": sum(len(t) for t in tokens),
        }
    )


def _details(state: State | None) -> dict[str, Any]:
    if state is None:
        return {
            "format": "gguf",
            "family": "",
            "families": None,
            "parameter_size": "",
            "quantization_level": "",
        }
    info = state.ctx.model_info
    return {
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture],
        "parameter_size": f"{info.n_params / 1e6:.0f}M",
        "quantization_level": "",
    }


def _entry(models: Models, name: str) -> dict[str, Any]:
    state = models.states().get(name)
    size = state.ctx.model_info.size_bytes if state is not None else 0
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(models.created, timezone.utc).isoformat(),
        "size": size,
        "digest": "",
        "details": _details(state),
    }


async def tags(request: Request, models: Models) -> Response:
    """``GET /api/tags``: the server's models."""
    return JSONResponse({"models": [_entry(models, n) for n in models.ids()]})


async def ps(request: Request, models: Models) -> Response:
    """``GET /api/ps``: the models open now, and when each closes if it
    stays idle (``--keep-alive``; none: the far date Ollama writes for
    "never")."""
    keep_alive = models.config.keep_alive
    out = []
    for name in models.loaded():
        if keep_alive is None:
            expires = "2318-01-01T00:00:00Z"
        else:
            idle = time.time() - (time.monotonic() - models.last_used(name))
            expires = datetime.fromtimestamp(idle + keep_alive, timezone.utc).isoformat()
        out.append({**_entry(models, name), "expires_at": expires, "size_vram": 0})
    return JSONResponse({"models": out})


async def version(request: Request, models: Models) -> Response:
    """``GET /api/version``."""
    return JSONResponse({"version": OLLAMA_VERSION, "lloyal": __version__})


async def show(request: Request, state: State) -> Response:
    """``POST /api/show``: the model's details, template and capabilities."""
    info = state.ctx.model_info
    capabilities = ["completion"]
    if state.config.embeddings:
        capabilities.append("embedding")
    if state.ctx.chat_template and "tool" in state.ctx.chat_template:
        capabilities.append("tools")
    projector = state.ctx.projector
    if projector is not None and projector.vision:
        capabilities.append("vision")
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": state.ctx.chat_template or "",
            "details": _details(state),
            "model_info": {
                "general.architecture": info.architecture,
                "general.parameter_count": info.n_params,
                f"{info.architecture}.context_length": info.n_ctx_train,
                f"{info.architecture}.embedding_length": info.n_embd,
                f"{info.architecture}.block_count": info.n_layer,
            },
            "capabilities": capabilities,
        }
    )
