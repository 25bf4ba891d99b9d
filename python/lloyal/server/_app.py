"""The Starlette application: every API's routes over :class:`Scheduler` (the
handlers live with their API: ``_openai.py``, ``_anthropic.py``,
``_llama.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from lloyal.branch import BranchStore
from lloyal.server._adapters import lora_adapters as _lora_adapters
from lloyal.server._anthropic import count_tokens, error_body, messages
from lloyal.server._auth import RequireKey
from lloyal.server._http import error_response, handler, internal_error, registry_handler
from lloyal.server._llama import (
    apply_template,
    completion,
    detokenize,
    infill,
    props,
    rerank,
    slots,
    tokenize,
)
from lloyal.server._models import Models
from lloyal.server._ollama import chat as ollama_chat
from lloyal.server._ollama import embed as ollama_embed
from lloyal.server._ollama import error_body as ollama_error
from lloyal.server._ollama import generate as ollama_generate
from lloyal.server._ollama import ps as ollama_ps
from lloyal.server._ollama import show as ollama_show
from lloyal.server._ollama import tags as ollama_tags
from lloyal.server._ollama import version as ollama_version
from lloyal.server._openai import chat_completions, completions, embeddings, model, models
from lloyal.server._protocol import ApiError
from lloyal.server._responses import ResponseStore, delete_response, get_response
from lloyal.server._responses import create as create_response
from lloyal.server._responses import input_tokens as response_input_tokens
from lloyal.server._state import ServerConfig, State

__all__ = ["ServerConfig", "create_app"]


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
     '/v1/messages/count_tokens', '/v1/models', '/v1/models/{model:path}', '/v1/rerank',
     '/v1/responses', '/v1/responses/input_tokens', '/v1/responses/{response_id}']
    """

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        registry = Models(config)
        app.state.lloyal = registry
        app.state.responses = ResponseStore()
        try:
            await registry.start()
            yield
        finally:
            await registry.aclose()

    openai_routes = [
        ("/chat/completions", chat_completions, ["POST"]),
        ("/completions", completions, ["POST"]),
        ("/embeddings", embeddings, ["POST"]),
        ("/responses", create_response, ["POST"]),
        ("/responses/input_tokens", response_input_tokens, ["POST"]),
    ]
    registry_routes = [
        ("/models", models, ["GET"]),
        ("/models/{model:path}", model, ["GET"]),
        ("/responses/{response_id}", get_response, ["GET"]),
        ("/responses/{response_id}", delete_response, ["DELETE"]),
    ]
    routes = [
        # Under /v1 and, as llama-server also serves them, without it.
        *(
            Route(prefix + path, handler(fn), methods=methods)
            for prefix in ("/v1", "")
            for path, fn, methods in openai_routes
        ),
        *(
            Route(prefix + path, registry_handler(fn), methods=methods)
            for prefix in ("/v1", "")
            for path, fn, methods in registry_routes
        ),
        # Anthropic's Messages API.
        Route("/v1/messages", handler(messages, error_body), methods=["POST"]),
        Route("/v1/messages/count_tokens", handler(count_tokens, error_body), methods=["POST"]),
        # Ollama's API.
        Route("/api/chat", handler(ollama_chat, ollama_error), methods=["POST"]),
        Route("/api/generate", handler(ollama_generate, ollama_error), methods=["POST"]),
        Route("/api/embed", handler(ollama_embed, ollama_error), methods=["POST"]),
        Route("/api/show", handler(ollama_show, ollama_error), methods=["POST"]),
        Route("/api/tags", registry_handler(ollama_tags), methods=["GET"]),
        Route("/api/ps", registry_handler(ollama_ps), methods=["GET"]),
        Route("/api/version", registry_handler(ollama_version), methods=["GET"]),
        Route("/health", registry_handler(health), methods=["GET"]),
        # llama-server's own.
        Route("/tokenize", handler(tokenize), methods=["POST"]),
        Route("/detokenize", handler(detokenize), methods=["POST"]),
        Route("/apply-template", handler(apply_template), methods=["POST"]),
        Route("/props", handler(props), methods=["GET"]),
        Route("/infill", handler(infill), methods=["POST"]),
        Route("/completion", handler(completion), methods=["POST"]),
        Route("/slots", handler(slots), methods=["GET"]),
        *(Route(p, handler(rerank), methods=["POST"]) for p in ("/v1/rerank", "/rerank")),
        Route("/metrics", registry_handler(metrics), methods=["GET"]),
        Route("/lora-adapters", handler(lora_adapters), methods=["GET", "POST"]),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _unhandled},
        middleware=[*_cors(config.cors_origins), Middleware(RequireKey, keys=config.api_keys)],
    )


def _cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS middleware for ``origins`` (outside the key check:
    a browser's preflight carries no key), or none."""
    if not origins:
        return []
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["*"],
            max_age=600,
        )
    ]


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404 no such route, 405 wrong method) as
    OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    return error_response(ApiError(exc.detail, status=exc.status_code))


async def _unhandled(request: Request, exc: Exception) -> Response:
    """The last resort: an exception outside every route's own mapping."""
    return error_response(internal_error(exc))
