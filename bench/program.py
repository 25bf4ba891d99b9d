"""One lloyal program over a batch of inputs, three ways, in one run:

- ``sequential``: ``await prog.run(ctx, x)`` for one input after another;
- ``run_batch``: ``await prog.run_batch(ctx, inputs)``, every input at once
  (their decodes shared: one ``llama_decode`` per step for the batch);
- ``server``: the same prompts and generations through ``lloyal serve``
  with the ``openai`` client, all requests at once (the server batches
  them its own way), what an SGLang-style frontend driving a server does.

Beside them, the ceiling: the same prompts and token counts run by plain
llama-cpp-2 calls with no lloyal code (``examples/raw_lockstep.rs``), one
prompt at a time and all at once. Its ratio is what batching can buy on
this host and model; run_batch's speed-up can only approach it.

The program appends a prompt and generates ``--tokens`` tokens (end of
text banned so every input generates the same number). Each way runs
``--runs`` times, taking turns; the table shows the best run's tok/s and
the ratios of run_batch to the others.

    python bench/program.py [--model smollm2|gemma3|PATH] [--inputs 32] [--tokens 24] [--runs 2]

Targets (issue 32): run_batch >= 3x sequential, and above the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import raw_lockstep
from lloyal.models import model_path

BANNED = {t: -100.0 for t in range(3)}  # the test models' end tokens (ids 0-2)


@lloyal.program
async def story(s: lloyal.ProgramState, i: int, tokens: int) -> None:
    s += _prompt(i)
    await s.gen("story", max_tokens=tokens)


def _prompt(i: int) -> str:
    return f"Story number {i}, about a lighthouse keeper and a storm. Once upon a time"


async def _sequential(ctx: lloyal.Context, n: int, tokens: int) -> float:
    params = lloyal.GREEDY.with_(logit_bias=BANNED)
    start = time.perf_counter()
    for i in range(n):
        await story.run(ctx, i, tokens, params=params)
    return time.perf_counter() - start


async def _batch(ctx: lloyal.Context, n: int, tokens: int) -> float:
    params = lloyal.GREEDY.with_(logit_bias=BANNED)
    start = time.perf_counter()
    await story.run_batch(ctx, [(i, tokens) for i in range(n)], params=params, progress=False)
    return time.perf_counter() - start


async def _server(url: str, n: int, tokens: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
    bias = {str(t): -100 for t in BANNED}
    start = time.perf_counter()
    replies = await asyncio.gather(
        *(
            client.completions.create(
                model="m", prompt=_prompt(i), max_tokens=tokens, temperature=0, logit_bias=bias
            )
            for i in range(n)
        )
    )
    seconds = time.perf_counter() - start
    await client.close()
    made = sum(r.usage.completion_tokens for r in replies if r.usage)
    if made != n * tokens:
        sys.exit(f"the server generated {made} tokens, not {n * tokens}")
    return seconds


def _start_server(model: Path, n: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable, "-m", "lloyal", "serve", "--model", str(model), "--port", str(port),
        "--n-seq-max", str(n + 1), "--n-ctx", str(128 * (n + 1)),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    sys.exit("lloyal serve did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-server", action="store_true")
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    n, tokens = args.inputs, args.tokens

    server = None if args.no_server else _start_server(path, n)
    best: dict[str, float] = {}

    raw: dict[str, float] = {}
    tokens_of: list[list[int]] = []

    async def measure() -> None:
        async with await lloyal.create_context(path, n_ctx=128 * n, n_seq_max=n) as ctx:
            await _batch(ctx, min(n, 4), 4)  # warm-up
            tokens_of.extend(ctx.tokenize_sync(_prompt(i)) for i in range(n))
            for _ in range(args.runs):
                for name, run in (("sequential", _sequential), ("run_batch", _batch)):
                    seconds = await run(ctx, n, tokens)
                    best[name] = min(best.get(name, seconds), seconds)
                if server is not None:
                    seconds = await _server(server[1], n, tokens)
                    best["server"] = min(best.get("server", seconds), seconds)

    try:
        asyncio.run(measure())
        # The ceiling, with lloyal's context closed (its KV memory freed).
        threads = os.cpu_count() or 1
        for _ in range(args.runs):
            for name, lanes in (("raw, one", 1), ("raw, all", n)):
                out = raw_lockstep(path, tokens_of, tokens, threads, lanes, "unified")
                raw[name] = min(raw.get(name, out["seconds"]), out["seconds"])
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait()
    total = n * tokens
    print(f"{path.name}: {n} inputs x {tokens} tokens, best of {args.runs} runs")
    print(f"{'way':<12} {'seconds':>8} {'tok/s':>8} {'run_batch speed-up':>19}")
    for name, seconds in best.items():
        ratio = seconds / best["run_batch"]
        print(f"{name:<12} {seconds:8.2f} {total / seconds:8.1f} {ratio:18.2f}x")
    ceiling = raw["raw, one"] / raw["raw, all"]
    print("plain llama.cpp, the same prompts and tokens (examples/raw_lockstep.rs):")
    for name, seconds in raw.items():
        print(f"{name:<12} {seconds:8.2f} {total / seconds:8.1f}")
    print(
        f"ceiling: all at once is {ceiling:.2f}x one at a time; run_batch gets "
        f"{best['sequential'] / best['run_batch']:.2f}x"
    )


if __name__ == "__main__":
    main()
