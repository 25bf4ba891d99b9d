"""The Starlette application: OpenAI's routes over :class:`Engine`."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from lloyal.branch import BranchStore
from lloyal.server._adapters import lora_adapters as _lora_adapters
from lloyal.server._anthropic import count_tokens, error_body, messages
from lloyal.server._auth import RequireKey
from lloyal.server._chat import ChatChoice, chat_events, prepare
from lloyal.server._completion import Completion, usage_body
from lloyal.server._engine import Event
from lloyal.server._http import (
    error_response,
    event_stream,
    handler,
    internal_error,
    primed,
    read_body,
    registry_handler,
    until_disconnect,
)
from lloyal.server._llama import apply_template, detokenize, infill, props, rerank, tokenize
from lloyal.server._models import Models
from lloyal.server._protocol import (
    ApiError,
    chat_request,
    completion_request,
    embedding_request,
)
from lloyal.server._state import ServerConfig, State

__all__ = ["ServerConfig", "create_app"]


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

    async def events() -> AsyncGenerator[Event, None]:
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
                    choice["delta"] = c.closing_delta()
                    _, choice["finish_reason"] = c.final(event.finish)
                else:
                    choice["delta"] = c.delta(event.text)
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
            message, finish = c.final(finishes.get(i, "stop"))
            entry: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
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
    runs = [Completion(state, req, i * gen.n) for i in range(len(req.prompts))]
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
    request: Request, state: State, run: Completion, head: dict[str, Any]
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


async def lora_adapters(request: Request, state: State) -> Response:
    return await _lora_adapters(request, state.ctx, state.engine.loras)


async def health(request: Request, models: Models) -> Response:
    return JSONResponse({"status": "ok"})


def _metrics(state: State) -> dict[str, float]:
    m = state.engine.metrics
    stats = state.ctx.stats
    store = BranchStore(state.ctx)
    cache = state.engine.cache.stats if state.engine.cache is not None else None
    return {
        "lloyal_requests_total": m.requests,
        "lloyal_requests_rejected_total": m.rejected,
        "lloyal_requests_active": m.active,
        "lloyal_requests_waiting": m.waiting,
        "lloyal_client_disconnects_total": m.disconnects,
        "lloyal_prompt_tokens_total": m.prompt_tokens,
        "lloyal_completion_tokens_total": m.completion_tokens,
        "lloyal_context_shifts_total": m.context_shifts,
        "lloyal_spec_drafted_total": m.spec_drafted,
        "lloyal_spec_accepted_total": m.spec_accepted,
        "lloyal_decode_calls_total": stats.decode_calls,
        "lloyal_tokens_decoded_total": stats.tokens_decoded,
        "lloyal_decode_seconds_total": round(stats.decode_seconds, 6),
        "lloyal_kv_leases_free": store.available,
        "lloyal_kv_pressure": store.kv_pressure,
        "lloyal_prefix_cache_entries": cache.entries if cache else 0,
        "lloyal_prefix_cache_hit_rate": cache.hit_rate if cache else 0.0,
        "lloyal_prefix_cache_saved_tokens_total": cache.saved_tokens if cache else 0,
        "lloyal_prefix_cache_disk_write_errors_total": cache.disk_write_errors if cache else 0,
    }


async def metrics(request: Request, models: Models) -> Response:
    """Prometheus text: one model's numbers, or with several each open
    model's under a ``model`` label, and how many are open."""
    states = models.states()
    if models.single:
        lines = [f"{k} {v}\n" for state in states.values() for k, v in _metrics(state).items()]
    else:
        lines = [f"lloyal_models_loaded {len(states)}\n"]
        lines += [
            f'{k}{{model="{name}"}} {v}\n'
            for name, state in states.items()
            for k, v in _metrics(state).items()
        ]
    return PlainTextResponse("".join(lines), media_type="text/plain; version=0.0.4")


def create_app(config: ServerConfig) -> Starlette:
    """The server as an ASGI application; the model opens at startup.

    >>> from lloyal.server import ServerConfig, create_app
    >>> app = create_app(ServerConfig(model_path=MODEL, n_seq_max=4))
    >>> paths = {r.path for r in app.routes}
    >>> sorted(p for p in paths if p.startswith("/v1"))  # doctest: +NORMALIZE_WHITESPACE
    ['/v1/chat/completions', '/v1/completions', '/v1/embeddings', '/v1/messages',
     '/v1/messages/count_tokens', '/v1/models', '/v1/models/{model:path}', '/v1/rerank']
    """

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = Models(config)
        app.state.lloyal = registry
        try:
            await registry.start()
            yield
        finally:
            await registry.aclose()

    openai_routes = [
        ("/chat/completions", chat_completions, ["POST"]),
        ("/completions", completions, ["POST"]),
        ("/embeddings", embeddings, ["POST"]),
    ]
    registry_routes = [("/models", models), ("/models/{model:path}", model)]
    routes = [
        # Under /v1 and, as llama-server also serves them, without it.
        *(
            Route(prefix + path, handler(fn), methods=methods)
            for prefix in ("/v1", "")
            for path, fn, methods in openai_routes
        ),
        *(
            Route(prefix + path, registry_handler(fn), methods=["GET"])
            for prefix in ("/v1", "")
            for path, fn in registry_routes
        ),
        # Anthropic's Messages API.
        Route("/v1/messages", handler(messages, error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", handler(count_tokens, error_body), methods=["POST"]),
        Route("/health", registry_handler(health), methods=["GET"]),
        # llama-server's own.
        Route("/tokenize", handler(tokenize), methods=["POST"]),
        Route("/detokenize", handler(detokenize), methods=["POST"]),
        Route("/apply-template", handler(apply_template), methods=["POST"]),
        Route("/props", handler(props), methods=["GET"]),
        Route("/infill", handler(infill), methods=["POST"]),
        *(Route(p, handler(rerank), methods=["POST"]) for p in ("/v1/rerank", "/rerank")),
        Route("/metrics", registry_handler(metrics), methods=["GET"]),
        Route("/lora-adapters", handler(lora_adapters), methods=["GET", "POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled},
        middleware=[Middleware(RequireKey, keys=config.api_keys)],
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404 no such route, 405 wrong method) as
    OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.detail, status=exc.status_code))


async def _unhandled(request: Request, exc: Exception) -> Response:
    """The last resort: an exception outside every route's own mapping."""
    return error_response(internal_error(exc))
