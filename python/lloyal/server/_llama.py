"""llama-server's own routes that editors and tools call: ``/tokenize``,
``/detokenize``, ``/apply-template``, ``/props``, ``/v1/rerank``,
``/infill``, ``/completion`` and ``/slots``, in its shapes."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal._lloyal import LLAMA_CPP_2_VERSION
from lloyal.errors import GrammarError
from lloyal.rerank import Rerank
from lloyal.server._chat import chat_prompt
from lloyal.server._completion import CompletionRun
from lloyal.server._engine import ChoiceEvent
from lloyal.server._http import event_stream, primed, until_disconnect
from lloyal.server._protocol import ApiError, chat_request, completion_request, parse_json
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


MAX_DOCUMENTS = 1000


async def rerank(request: Request, state: State) -> Response:
    """``{"query", "documents": [str], "top_n"?, "return_documents"?}`` ->
    ``{"results": [{"index", "relevance_score"}]}``, best first (Jina's and
    Cohere's shape, as llama-server answers it). A reranker model's scores
    are its own (rank pooling, :class:`lloyal.Rerank` with
    ``method="rank"``); another model's are the cosine of the query's and
    each document's embedding on the server's pooling context
    (``method="embedding"``)."""
    body = _body(await request.body())
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query.strip():
        raise ApiError("query must be a non-empty string", param="query")
    if (
        not isinstance(documents, list)
        or not 0 < len(documents) <= MAX_DOCUMENTS
        or not all(isinstance(d, str) and d for d in documents)
    ):
        raise ApiError(
            f"documents must be 1 to {MAX_DOCUMENTS} non-empty strings", param="documents"
        )
    top_n = body.get("top_n", len(documents))
    if type(top_n) is not int or top_n < 1:
        raise ApiError("top_n must be a positive integer", param="top_n")
    if not state.config.embeddings:
        raise ApiError("embeddings (and so rerank) are off on this server", status=404)
    ctx = await state.embedder()
    if ctx.ranks:
        ranker = Rerank(ctx, method="rank")
        inputs = [await ranker.pair(query, d) for d in documents]
    else:
        inputs = [await ctx.tokenize(t) for t in (query, *documents)]
    if max(len(t) for t in inputs) > ctx.n_batch:
        raise ApiError(f"the query and each document may have at most {ctx.n_batch} tokens")
    rows = await ctx.embed_tokens(inputs)
    scores = rows[:, 0] if ctx.ranks else rows[1:] @ rows[0]
    order = sorted(range(len(documents)), key=lambda i: -float(scores[i]))[:top_n]
    results: list[dict[str, Any]] = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if _flag(body, "return_documents", False):
            entry["document"] = {"text": documents[i]}
        results.append(entry)
    total = sum(len(t) for t in inputs)
    return JSONResponse(
        {
            "model": state.name,
            "object": "list",
            "results": results,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
    )


_STOP_TYPES = {"stop": "eos", "length": "limit"}
_FIM_FIELDS = ("input_prefix", "input_suffix", "input_extra", "prompt")


async def infill(request: Request, state: State) -> Response:
    """Fill in the middle, llama-server's way: ``{"input_prefix",
    "input_suffix", "input_extra": [{"filename", "text"}], "prompt" (text
    already at the cursor), "n_predict", "stream"}`` and the completion
    sampling fields -> ``{"content", "stop": true, "stop_type",
    "stopping_word", "tokens_predicted", "tokens_evaluated",
    "tokens_cached"}``; streamed, each piece as ``{"content", "stop":
    false}`` and the same last object. A 400 for a model without FIM
    tokens (:mod:`lloyal.infill`)."""
    body = _body(await request.body())
    texts = {k: body.get(k, "") for k in ("input_prefix", "input_suffix", "prompt")}
    for name, value in texts.items():
        if not isinstance(value, str):
            raise ApiError(f"{name} must be a string", param=name)
    files = _extra_files(body.get("input_extra", []))
    rest = {k: v for k, v in body.items() if k not in _FIM_FIELDS}
    # The sampling fields checked as a completion's ("prompt" is replaced).
    req = completion_request({**rest, "prompt": "-"}, vocab_size=state.ctx.vocab_size)
    if req.generation.n != 1:
        raise ApiError("infill makes one reply", param="n")
    run = CompletionRun(state, req, 0)
    await run.prepare_fim(
        texts["input_prefix"], texts["input_suffix"], middle=texts["prompt"], files=files
    )
    return await _reply(request, state, run)


async def completion(request: Request, state: State) -> Response:
    """llama-server's ``/completion``: ``{"prompt" (text or token ids),
    "n_predict", "stream", "grammar" (GBNF), "json_schema"}`` and the
    completion sampling fields -> the same objects as :func:`infill`."""
    body = _body(await request.body())
    rest = {k: v for k, v in body.items() if k not in ("grammar", "json_schema")}
    req = completion_request(rest, vocab_size=state.ctx.vocab_size)
    if req.generation.n != 1 or len(req.prompts) != 1:
        raise ApiError("/completion makes one reply to one prompt", param="prompt")
    grammar, schema = body.get("grammar"), body.get("json_schema")
    if grammar is not None and schema is not None:
        raise ApiError("give grammar or json_schema, not both", param="grammar")
    if grammar is not None and (not isinstance(grammar, str) or not grammar.strip()):
        raise ApiError("grammar must be a GBNF grammar (a string)", param="grammar")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise ApiError("json_schema must be a JSON schema", param="json_schema")
    try:
        if grammar is not None:
            compiled = state.ctx.create_grammar(grammar)
        elif schema is not None:
            compiled = state.ctx.create_grammar(json_schema=schema)
        else:
            compiled = None
    except GrammarError as e:
        raise ApiError(str(e), param="grammar" if grammar is not None else "json_schema") from None
    run = CompletionRun(state, req, 0, grammar=compiled)
    await run.prepare(req.prompts[0])
    return await _reply(request, state, run)


async def slots(request: Request, state: State) -> Response:
    """llama-server's ``/slots``, as far as lloyal has slots: one per KV
    lease (``--n-seq-max``), ``is_processing`` for as many as requests run
    now (a request holds branches, not a numbered slot)."""
    running = state.engine.metrics.active
    n = state.ctx.n_seq_max
    return JSONResponse(
        [{"id": i, "n_ctx": state.ctx.n_ctx, "is_processing": i < running} for i in range(n)]
    )


async def _reply(request: Request, state: State, run: CompletionRun) -> Response:
    """A one-choice run in llama-server's shapes: ``{"content", "stop":
    true, "stop_type", "stopping_word", "tokens_predicted",
    "tokens_evaluated", "tokens_cached"}``; streamed, each piece as
    ``{"content", "stop": false}`` and the same last object."""
    finish: dict[str, Any] = {}

    def last() -> dict[str, Any]:
        end, word = finish.get("finish", "stop"), finish.get("stop")
        return {
            "index": 0,
            "content": "",
            "stop": True,
            "stop_type": "word" if word is not None else _STOP_TYPES.get(end, "eos"),
            "stopping_word": word or "",
            "model": state.name,
            "tokens_predicted": run.counts[0],
            "tokens_evaluated": len(run.tokens),
            "tokens_cached": run.cached,
        }

    async def events() -> AsyncGenerator[ChoiceEvent, None]:
        async for event in run.events():
            if event.finish is not None:
                finish.update(finish=event.finish, stop=event.stop)
            yield event

    if run.gen.stream:
        source = await primed(events(), request)

        async def bodies() -> AsyncGenerator[dict[str, Any], None]:
            async for event in source:
                if event.finish is None and event.text:
                    yield {"index": 0, "content": event.text, "stop": False}
            yield last()

        return event_stream(state, source, bodies(), done=None)

    async def collect() -> Response:
        async for _ in events():
            pass
        return JSONResponse({**last(), "content": run.texts[0]})

    return await until_disconnect(request, collect())


def _extra_files(value: object) -> tuple[tuple[str, str], ...]:
    """``input_extra``: ``[{"filename": str, "text": str}]``."""
    if not isinstance(value, list):
        raise ApiError("input_extra must be a list", param="input_extra")
    files = []
    for chunk in value:
        name = chunk.get("filename", "") if isinstance(chunk, dict) else None
        text = chunk.get("text") if isinstance(chunk, dict) else None
        if not isinstance(name, str) or not isinstance(text, str):
            raise ApiError(
                'each input_extra item is {"filename": str, "text": str}', param="input_extra"
            )
        files.append((name, text))
    return tuple(files)
