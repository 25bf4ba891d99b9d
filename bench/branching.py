"""Lockstep branch decoding: the Python Branch API next to a raw Rust
batched loop over llama-cpp-2, in one run.

For N = 1, 2, 4, 8, 16 branches forked from a shared 128-token prompt, both
sides decode STEPS tokens per branch, one ``llama_decode`` per step, and
report aggregate tok/s; runs alternate (raw, python, ...) and medians are
printed with their ratio. Also prints fork latency at 10 / 1000 / 3000
token prefixes next to llama.cpp's own sequence copy (via the raw loop's
numbers is not possible from Python, so the reference figures measured on
the development machine are printed beside ours).

    python bench/branching.py [--model smollm2|gemma3|PATH] [--steps 64] [--runs 3]

With ``--llama-cpp-python`` it also runs best-of-N the way llama-cpp-python
users must (save_state / load_state, one candidate after another), in a
virtual environment it creates under ~/.cache/lloyal/bench-venv (building
llama-cpp-python from source takes several minutes the first time).

Targets (issue 3): Python >= 0.95x the raw loop at every N; fork latency
<= raw seq copy + 50 us (reference on SmolLM2, unified KV: 6 us at 10
tokens, 82 us at 1,000, 171 us at 3,000).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import build_example, median, run_json
from lloyal.models import KNOWN_MODELS, model_path

PROMPT_TOKENS = 128
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. "
)
RAW_SEQ_COPY_US = {10: 6, 1000: 82, 3000: 171}


def n_ctx_for(n: int, steps: int) -> int:
    return max(1024, PROMPT_TOKENS + n * (steps + 8))


async def python_lockstep(path: Path, prompt: list[int], n: int, steps: int, threads: int) -> float:
    async with await lloyal.create_context(
        path, n_ctx=n_ctx_for(n, steps), n_seq_max=n + 1, n_threads=threads
    ) as ctx:
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.GREEDY)
        await root.prefill(prompt)
        branches = [await root.fork() for _ in range(n)]
        started = time.perf_counter()
        for _ in range(steps):
            await store.commit([(b, (await b.produce()).token) for b in branches])
        return time.perf_counter() - started


async def fork_latency(path: Path, prefix: int, threads: int, repeats: int = 50) -> float:
    async with await lloyal.create_context(
        path, n_ctx=prefix + 512, n_seq_max=2, n_threads=threads
    ) as ctx:
        root = lloyal.Branch.create(ctx)
        tokens = (await ctx.tokenize(TEXT * (prefix // 20 + 2)))[:prefix]
        await lloyal.BranchStore(ctx).prefill([(root, tokens)])
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            child = await root.fork()
            samples.append(time.perf_counter() - started)
            await child.prune()
        return median(samples) * 1e6


VENV = Path.home() / ".cache" / "lloyal" / "bench-venv"


def llama_cpp_python() -> Path:
    """A venv with llama-cpp-python, built for this CPU."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode != 0:
        print("building llama-cpp-python in", VENV, "(several minutes)", file=sys.stderr)
        env = {**os.environ, "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "llama-cpp-python"], check=True, env=env
        )
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--widths", default="1,2,4,8,16")
    parser.add_argument(
        "--llama-cpp-python", action="store_true", help="also time best-of-N in llama-cpp-python"
    )
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    widths = [int(w) for w in args.widths.split(",")]
    raw_bin = build_example("raw_batched")
    lcp = llama_cpp_python() if args.llama_cpp_python else None
    lcp_script = Path(__file__).resolve().parent / "llama_cpp_python_best_of_n.py"
    print(f"threads={args.threads} prompt={PROMPT_TOKENS} steps={args.steps} runs={args.runs}")
    for name in args.model or list(KNOWN_MODELS):
        path = model_path(name) if name in KNOWN_MODELS else Path(name)

        async def tokenize(p: Path = path) -> list[int]:
            async with await lloyal.create_context(p) as ctx:
                return (await ctx.tokenize(TEXT * 10))[:PROMPT_TOKENS]

        prompt = asyncio.run(tokenize())
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(prompt, f)
            tokens_file = f.name
        print(f"\n{name}: aggregate tok/s, N branches in lockstep")
        extra = f" {'llama-cpp-python':>17} {'ours/lcp':>9}" if lcp else ""
        print(f"{'N':>4} {'raw Rust':>10} {'Python':>10} {'ratio':>7}{extra}")
        rows: list[dict[str, float | None]] = []
        forks: dict[int, float] = {}
        results[name] = {"lockstep": rows, "fork_us": forks, "seq_cp_ref_us": RAW_SEQ_COPY_US}
        for n in widths:
            raw, py = [], []
            for _ in range(args.runs):
                r = run_json(
                    [
                        str(raw_bin),
                        str(path),
                        tokens_file,
                        str(n),
                        str(args.steps),
                        str(args.threads),
                        str(n_ctx_for(n, args.steps)),
                    ]
                )
                raw.append(n * args.steps / r["seconds"])
                seconds = asyncio.run(python_lockstep(path, prompt, n, args.steps, args.threads))
                py.append(n * args.steps / seconds)
            r_med, p_med = median(raw), median(py)
            row: dict[str, float | None] = {"n": n, "raw": r_med, "python": p_med, "lcp": None}
            rows.append(row)
            line = f"{n:>4} {r_med:>10.1f} {p_med:>10.1f} {p_med / r_med:>6.3f}x"
            if lcp:
                out = run_json(
                    [
                        str(lcp),
                        str(lcp_script),
                        str(path),
                        tokens_file,
                        str(n),
                        str(args.steps),
                        str(args.threads),
                    ]
                )
                lcp_tps = n * args.steps / out["seconds"]
                row["lcp"] = lcp_tps
                line += f" {lcp_tps:>17.1f} {p_med / lcp_tps:>8.2f}x"
            print(line)
        os.unlink(tokens_file)
        print(f"\n{name}: fork latency (median of 50)")
        print(f"{'prefix':>7} {'lloyal fork':>12} {'llama.cpp seq_cp (ref, SmolLM2)':>34}")
        for prefix, ref in RAW_SEQ_COPY_US.items():
            us = asyncio.run(fork_latency(path, prefix, args.threads))
            forks[prefix] = us
            print(f"{prefix:>7} {us:>10.0f}us {ref:>32}us")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
