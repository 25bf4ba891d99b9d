"""Prefill and decode speed of the Python API next to a raw Rust loop.

Both sides load the same model with the same context settings and threads,
prefill the same 512-token prompt in one llama_decode, then generate the
same greedy tokens one at a time. Each run is a fresh process on both
sides (the raw Rust example; this script as a child), the two taking turns
in alternating order so that machine noise hits both; printed: the medians,
the median of the runs' ratios, and their min and max (the host's noise).

    python bench/decode.py [--model smollm2|gemma3|PATH] [--runs 7] [--gen 128]
    python bench/decode.py --compare-wheel .venv-wheel/bin/python [--runs 5]

``--compare-wheel PYTHON`` measures the installed portable wheel (in the
venv of PYTHON, e.g. the one ``make test-wheel`` leaves) against this
checkout's native source build instead: the same Python loop in two child
processes, taking turns, with the wheel's chosen CPU variant printed.
Target: wheel >= 0.97x native for prefill and decode.

Target: Python decode >= 0.97x raw. For reference, llama.cpp's llama-bench
on the 2-core development machine (2 threads, AVX2): SmolLM2-135M Q4_1
106 tok/s decode, 204 tok/s prefill (512 tokens); Gemma 3 270M Q4_K_M 54
and 303. A build far below these is missing vector instructions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import build_example, median, run_json
from lloyal.models import KNOWN_MODELS, model_path

N_CTX = 1024
PROMPT_TOKENS = 512


async def python_run(path: Path, prompt: list[int], n_gen: int, threads: int) -> dict[str, float]:
    async with await lloyal.create_context(
        path, n_ctx=N_CTX, n_batch=PROMPT_TOKENS, n_threads=threads
    ) as ctx:
        started = time.perf_counter()
        await ctx.decode(prompt, 0)
        prefill_s = time.perf_counter() - started
        token = ctx.greedy_sample()
        generated = []
        started = time.perf_counter()
        for i in range(n_gen):
            generated.append(token)
            await ctx.decode([token], len(prompt) + i)
            token = ctx.greedy_sample()
        decode_s = time.perf_counter() - started
    return {"prefill_s": prefill_s, "decode_s": decode_s, "generated": generated}  # type: ignore[dict-item]


def make_prompt(path: Path) -> list[int]:
    async def tok() -> list[int]:
        async with await lloyal.create_context(path, n_ctx=N_CTX) as ctx:
            text = ROOT_TEXT * 40
            return (await ctx.tokenize(text))[:PROMPT_TOKENS]

    return asyncio.run(tok())


ROOT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. "
)


def print_header(args: argparse.Namespace, left: str, right: str) -> None:
    print(f"threads={args.threads} prompt={PROMPT_TOKENS} generated={args.gen} runs={args.runs}")
    header = f"{'model':<10} {'':<8} {left:>13} {right:>13} {'ratio':>7}"
    print(header)
    print("-" * len(header))


def model_prompt(name: str) -> tuple[Path, list[int], str]:
    """The model's path, its 512-token prompt, and a file holding the prompt
    (the child processes read it; the caller removes it)."""
    path = model_path(name) if name in KNOWN_MODELS else Path(name)
    prompt = make_prompt(path)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
    return path, prompt, f.name


def child(path: Path, tokens_file: str, n_gen: int, threads: int) -> None:
    """One timed Python run in this interpreter's lloyal, as JSON on stdout."""
    with open(tokens_file) as f:
        prompt = json.load(f)
    result: dict[str, object] = dict(asyncio.run(python_run(path, prompt, n_gen, threads)))
    info = lloyal.backend_info()
    result["build"] = info.cpu_variant or "native"
    print(json.dumps(result))


def compare_wheel(args: argparse.Namespace, names: list[str]) -> None:
    """Native source build vs the installed wheel, alternating child processes."""
    sides = {"native": sys.executable, "wheel": args.compare_wheel}
    print_header(args, "native tok/s", "wheel tok/s")
    for name in names:
        path, prompt, tokens_file = model_prompt(name)
        rates: dict[str, dict[str, list[float]]] = {
            side: {"prefill": [], "decode": []} for side in sides
        }
        builds: dict[str, str] = {}
        outputs: dict[str, list[int]] = {}
        for i in range(args.runs):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                cmd = [sides[side], __file__, "--child", str(path), tokens_file]
                r = run_json([*cmd, str(args.gen), str(args.threads)])
                rates[side]["prefill"].append(len(prompt) / r["prefill_s"])
                rates[side]["decode"].append(args.gen / r["decode_s"])
                builds[side], outputs[side] = r["build"], r["generated"]
        os.unlink(tokens_file)
        for phase in ("prefill", "decode"):
            n_med, w_med = median(rates["native"][phase]), median(rates["wheel"][phase])
            print(f"{name:<10} {phase:<8} {n_med:>13.1f} {w_med:>13.1f} {w_med / n_med:>6.3f}x")
        same = "the same" if outputs["native"] == outputs["wheel"] else "different"
        print(f"  wheel's CPU variant: {builds['wheel']}; greedy tokens {same}")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        path, tokens_file, n_gen, threads = sys.argv[2:6]
        child(Path(path), tokens_file, int(n_gen), int(threads))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="smollm2, gemma3 or a path (repeatable)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--compare-wheel",
        metavar="PYTHON",
        help="a venv's python with the wheel installed: compare it with this checkout's build",
    )
    args = parser.parse_args()
    names = args.model or list(KNOWN_MODELS)
    if args.compare_wheel:
        compare_wheel(args, names)
        return
    raw_bin = build_example("raw_decode")

    print_header(args, "raw tok/s", "python tok/s")
    for name in names:
        path, prompt, tokens_file = model_prompt(name)
        sides = {
            "raw": [str(raw_bin), str(path), tokens_file, str(args.gen), str(args.threads)],
            "python": [sys.executable, __file__, "--child", str(path), tokens_file],
        }
        sides["raw"].append(str(N_CTX))
        sides["python"] += [str(args.gen), str(args.threads)]
        rates: dict[str, dict[str, list[float]]] = {
            side: {"prefill": [], "decode": []} for side in sides
        }
        outputs: dict[str, list[int]] = {}
        for i in range(args.runs):
            # Each run a fresh process on both sides, in alternating order.
            for side in list(sides) if i % 2 == 0 else list(reversed(sides)):
                r = run_json(sides[side])
                rates[side]["prefill"].append(len(prompt) / r["prefill_s"])
                rates[side]["decode"].append(args.gen / r["decode_s"])
                outputs[side] = r["generated"]
        os.unlink(tokens_file)
        if outputs["raw"] != outputs["python"]:
            print(f"  warning: {name}: raw and python greedy outputs differ", file=sys.stderr)
        for phase in ("prefill", "decode"):
            raw, py = rates["raw"][phase], rates["python"][phase]
            ratios = sorted(p / r for p, r in zip(py, raw, strict=True))
            print(
                f"{name:<10} {phase:<8} {median(raw):>13.1f} {median(py):>13.1f} "
                f"{median(ratios):>6.3f}x  (runs' ratios {ratios[0]:.3f}-{ratios[-1]:.3f})"
            )


if __name__ == "__main__":
    main()
