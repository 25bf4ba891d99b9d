"""OpenAI's API: chat completions, completions, embeddings and models,
written from the engine's events and a chat choice's typed deltas."""

from __future__ import annotations

import asyncio
import base64
import time
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
    prepare,
)
from lloyal.server._completion import CompletionRun, usage_body
from lloyal.server._engine import ChoiceEvent
from lloyal.server._http import event_stream, primed, read_body, until_disconnect
from lloyal.server._models import Models
from lloyal.server._protocol import (
    ApiError,
    EmbeddingRequest,
    chat_request,
    completion_request,
    integer_field,
    json_object,
)
from lloyal.server._state import State


def _delta(deltas: list[Delta]) -> dict[str, Any]:
    """A chat chunk's ``delta``: the content, reasoning and tool-call
    pieces of one step."""
    out: dict[str, Any] = {}
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if isinstance(d, TextDelta):
            out["content"] = out.get("content", "") + d.text
        elif isinstance(d, ReasoningDelta):
            out["reasoning_content"] = out.get("reasoning_content", "") + d.text
        elif isinstance(d, CallStart):
            fn = {"name": d.name, "arguments": d.arguments}
            calls.append({"index": d.index, "id": d.id, "type": "function", "function": fn})
        elif isinstance(d, CallArguments):
            calls.append({"index": d.index, "function": {"arguments": d.arguments}})
    if calls:
        out["tool_calls"] = calls
    return out


def _message(reply: Reply) -> dict[str, Any]:
    """A finished reply as an assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in reply.calls
        ]
    return message


def _logprob_entry(state: State, token: int, logprob: float, top: Any) -> dict[str, Any]:
    text, raw = state.token_info(token)
    return {
        "token": text,
        "logprob": logprob,
        "bytes": raw,
        "top_logprobs": [
            {"token": t_text, "logprob": lp, "bytes": t_raw}
            for (t_text, t_raw), lp in ((state.token_info(t), lp) for t, lp in top)
        ],
    }


# -- chat completions -------------------------------------------------------------


async def chat_completions(request: Request, state: State) -> Response:
    req = chat_request(await read_body(request), vocab_size=state.ctx.vocab_size)
    gen = req.generation
    prompt, grammar, tokens = await prepare(state, req)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": state.name,
    }
    split = (req.reasoning_format or state.config.reasoning_format) != "none"
    choices = [ChatChoice(prompt, split_reasoning=split) for _ in range(gen.n)]
    cached = 0

    def usage() -> dict[str, Any]:
        return usage_body(len(tokens), sum(c.tokens for c in choices), cached)

    async def events() -> AsyncGenerator[ChoiceEvent, None]:
        nonlocal cached
        async for event in chat_events(state, tokens, gen, prompt, grammar):
            cached = event.cached if event.cached is not None else cached
            if event.token is not None:
                choices[event.index].tokens += 1
                if event.logprob is not None:
                    choices[event.index].logprobs.append(
                        _logprob_entry(state, event.token, event.logprob, event.top)
                    )
            yield event

    if gen.stream:
        source = await primed(events(), request)
        chunk = {**head, "object": "chat.completion.chunk"}

        async def bodies() -> AsyncGenerator[dict[str, Any], None]:
            for i in range(gen.n):
                opener = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield {**chunk, "choices": [opener]}
            async for event in source:
                c = choices[event.index]
                # OpenAI sends both keys in every chunk, null until set.
                choice: dict[str, Any] = {
                    "index": event.index,
                    "delta": {},
                    "logprobs": None,
                    "finish_reason": None,
                }
                if event.finish is not None:
                    choice["delta"] = _delta(c.closing(event.finish))
                    choice["finish_reason"] = c.final(event.finish).finish
                else:
                    choice["delta"] = _delta(c.delta(event.text))
                    if event.logprob is not None:
                        choice["logprobs"] = {"content": [c.logprobs[-1]]}
                    if not choice["delta"] and choice["logprobs"] is None:
                        continue
                yield {**chunk, "choices": [choice]}
            if gen.include_usage:
                yield {**chunk, "choices": [], "usage": usage()}

        return event_stream(state, source, bodies())

    async def collect() -> Response:
        finishes: dict[int, str] = {}
        async for event in events():
            if event.finish is not None:
                finishes[event.index] = event.finish
            else:
                choices[event.index].text += event.text
        body_choices = []
        for i, c in enumerate(choices):
            reply = c.final(finishes.get(i, "stop"))
            entry: dict[str, Any] = {
                "index": i,
                "message": _message(reply),
                "finish_reason": reply.finish,
            }
            entry["logprobs"] = {"content": c.logprobs} if gen.logprobs is not None else None
            body_choices.append(entry)
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": body_choices, "usage": usage()}
        )

    return await until_disconnect(request, collect())


# -- completions ---------------------------------------------------------------------


async def completions(request: Request, state: State) -> Response:
    req = completion_request(await read_body(request), vocab_size=state.ctx.vocab_size)
    gen = req.generation
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": state.name}
    runs = [CompletionRun(state, req, i * gen.n) for i in range(len(req.prompts))]
    for run, prompt in zip(runs, req.prompts, strict=True):
        await run.prepare(prompt)
    if gen.stream:
        return await _stream_completion(request, state, runs[0], head)

    async def collect() -> Response:
        # Several prompts run side by side, each admitted on its own.
        parts = await asyncio.gather(*(run.choices() for run in runs))
        usage = usage_body(
            sum(len(run.tokens) for run in runs),
            sum(sum(run.counts) for run in runs),
            sum(run.cached for run in runs),
        )
        choices = [c for part in parts for c in part]
        return JSONResponse(
            {**head, "object": "text_completion", "choices": choices, "usage": usage}
        )

    return await until_disconnect(request, collect())


async def _stream_completion(
    request: Request, state: State, run: CompletionRun, head: dict[str, Any]
) -> Response:
    gen, req = run.gen, run.req
    source = await primed(run.events(), request)
    chunk = {**head, "object": "text_completion"}

    async def bodies() -> AsyncGenerator[dict[str, Any], None]:
        if req.echo:  # the prompt first, as OpenAI streams it
            for i in range(gen.n):
                echoed = {"index": i, "text": run.prompt_text, "logprobs": None}
                yield {**chunk, "choices": [{**echoed, "finish_reason": None}]}
        async for event in source:
            token_lp = event.finish is None and event.logprob is not None
            if event.finish is None and not event.text and not token_lp:
                continue
            lp = run.lps[event.index]
            choice = {
                "index": event.index,
                "text": event.text,
                # This token's entry (``record`` saw the event first).
                "logprobs": {k: v[-1:] for k, v in lp.items()} if token_lp else None,
                "finish_reason": event.finish,
            }
            yield {**chunk, "choices": [choice]}
        if gen.include_usage:
            yield {**chunk, "choices": [], "usage": run.usage()}

    return event_stream(state, source, bodies())


# -- the rest ------------------------------------------------------------------------


def embedding_request(raw: object, *, vocab_size: int) -> EmbeddingRequest:
    body = json_object(raw)
    value = body.get("input")
    # A string, strings, a list of token ids, or lists of them (OpenAI's
    # four shapes; langchain sends token ids by default).
    if isinstance(value, list) and value and all(_is_id(t) for t in value):
        value = [value]
    inputs = [value] if isinstance(value, str) else value
    texts = isinstance(inputs, list) and all(isinstance(t, str) and t for t in inputs)
    ids = isinstance(inputs, list) and all(
        isinstance(t, list) and t and all(_is_id(x) for x in t) for t in inputs
    )
    if not isinstance(inputs, list) or not inputs or not (texts or ids):
        raise ApiError(
            "input must be a non-empty string, a list of strings, a list of token ids "
            "or a list of such lists",
            param="input",
        )
    if ids and any(not 0 <= x < vocab_size for t in inputs for x in t):
        raise ApiError(f"input token ids must be in [0, {vocab_size})", param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError("encoding_format must be 'float' or 'base64'", param="encoding_format")
    dimensions = integer_field(body, "dimensions", None, 1, 1 << 20)
    return EmbeddingRequest(inputs=list(inputs), base64=encoding == "base64", dimensions=dimensions)


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


async def embeddings(request: Request, state: State) -> Response:
    req = embedding_request(await read_body(request), vocab_size=state.ctx.vocab_size)
    if not state.config.embeddings:
        raise ApiError("embeddings are off on this server", status=404)
    if state.reranker:
        raise ApiError("this model is a reranker: it scores pairs on /v1/rerank", status=404)
    ctx = await state.embedder()
    if req.dimensions is not None and req.dimensions != ctx.embedding_dim:
        raise ApiError(
            f"this model's embeddings have {ctx.embedding_dim} dimensions; "
            "other sizes are not made",
            param="dimensions",
        )
    inputs = [t if isinstance(t, list) else await ctx.tokenize(t) for t in req.inputs]
    counts = [len(t) for t in inputs]
    if max(counts) > ctx.n_batch:
        raise ApiError(f"each input may have at most {ctx.n_batch} tokens", param="input")
    rows = await ctx.embed_tokens(inputs)
    data = [
        {
            "object": "embedding",
            "index": i,
            # base64: the float32 vector's little-endian bytes (the openai
            # client asks for this by default and decodes it).
            "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode()
            if req.base64
            else row.tolist(),
        }
        for i, row in enumerate(rows)
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": state.name,
            "usage": {"prompt_tokens": sum(counts), "total_tokens": sum(counts)},
        }
    )


def _model_object(models: Models, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": models.created,
        "owned_by": "lloyal",
        # llama-server's router says which models are in memory.
        "status": {"value": "loaded" if models.is_open(name) else "unloaded"},
    }


async def models(request: Request, models: Models) -> Response:
    data = [_model_object(models, name) for name in models.ids()]
    return JSONResponse({"object": "list", "data": data})


async def model(request: Request, models: Models) -> Response:
    """``GET /v1/models/{id}``: the model, or OpenAI's 404."""
    name = request.path_params["model"]
    if name not in models.ids():
        raise ApiError(
            f"The model '{name}' does not exist",
            status=404,
            param="model",
            code="model_not_found",
        )
    return JSONResponse(_model_object(models, name))
