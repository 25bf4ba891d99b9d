"""llama-server's own routes that editors and tools call: ``/tokenize``,
``/detokenize``, ``/apply-template`` and ``/props``, in its shapes."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal._lloyal import LLAMA_CPP_2_VERSION
from lloyal.server._chat import chat_prompt
from lloyal.server._protocol import ApiError, chat_request, parse_json
from lloyal.server._state import State

# The most tokens /detokenize takes in one request.
MAX_DETOKENIZE = 1 << 20


def _body(raw: bytes) -> dict[str, Any]:
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", param=name)
    return value


async def tokenize(request: Request, state: State) -> Response:
    """``{"content": str, "add_special": false, "parse_special": true,
    "with_pieces": false}`` -> ``{"tokens": [...]}`` (with pieces:
    ``[{"id", "piece"}]``, a piece that is not whole UTF-8 as its bytes)."""
    body = _body(await request.body())
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError("content must be a string", param="content")
    ctx = state.ctx
    tokens = await ctx.tokenize(
        content,
        add_special=_flag(body, "add_special", False),
        parse_special=_flag(body, "parse_special", True),
    )
    if not _flag(body, "with_pieces", False):
        return JSONResponse({"tokens": tokens})
    pieces: list[dict[str, Any]] = []
    for t in tokens:
        raw = ctx.token_bytes(t, render_special=True)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": pieces})


async def detokenize(request: Request, state: State) -> Response:
    """``{"tokens": [...]}`` -> ``{"content": str}`` (special tokens
    rendered, as llama-server does)."""
    body = _body(await request.body())
    tokens = body.get("tokens")
    vocab = state.ctx.vocab_size
    if (
        not isinstance(tokens, list)
        or len(tokens) > MAX_DETOKENIZE
        or not all(type(t) is int and 0 <= t < vocab for t in tokens)
    ):
        raise ApiError(
            f"tokens must be a list of at most {MAX_DETOKENIZE} token ids in [0, {vocab})",
            param="tokens",
        )
    content = await state.ctx.detokenize(tokens, render_special=True)
    return JSONResponse({"content": content})


async def apply_template(request: Request, state: State) -> Response:
    """A chat request's ``messages`` (and ``tools``) rendered with the
    server's template: ``{"prompt": str}``."""
    req = chat_request(parse_json(await request.body()), vocab_size=state.ctx.vocab_size)
    prompt = chat_prompt(state.ctx, state.config.template, req)
    return JSONResponse({"prompt": prompt.prompt})


async def props(request: Request, state: State) -> Response:
    """What the server runs: llama-server's ``/props`` fields that clients
    read (context size, slots, template, modalities)."""
    ctx = state.ctx
    projector = ctx.projector
    return JSONResponse(
        {
            "default_generation_settings": {"n_ctx": ctx.n_ctx, "model": state.name},
            "total_slots": ctx.n_seq_max,
            "model_alias": state.name,
            "model_path": str(state.config.model_path),
            "chat_template": ctx.chat_template or state.config.template or "",
            "modalities": {
                "vision": bool(projector and projector.vision),
                "audio": bool(projector and projector.audio),
            },
            "build_info": f"lloyal (llama-cpp-2 {LLAMA_CPP_2_VERSION})",
        }
    )
