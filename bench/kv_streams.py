"""Unified KV against one KV stream per sequence, in plain llama.cpp.

lloyal runs llama.cpp with a unified KV cache: every sequence's cells sit
in one pool, which is what lets a fork share its parent's cells. The
price is in attention: each token's attention scans every used cell of
the pool (the ones of other sequences are masked, but still visited), so
with C sequences of L cells each a decode does work in C * L per token.
llama-server runs its slots with ``kv_unified`` off: one stream of cells
per sequence, each token scanning only its own.

This measures that price with no lloyal code in the loop
(``examples/raw_lockstep.rs``): C distinct prompts of a server-like length
prefilled together, then ``--steps`` lockstep greedy steps, one decode each,
in both layouts, taking turns. Printed per C: seconds per step in each and
the ratio split / unified of steps per second (above 1: split is faster).

    python bench/kv_streams.py [--model smollm2|gemma3|PATH] [--clients 8,32,64]
                               [--steps 128] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import build_example, run_json
from lloyal.models import model_path


def _prompt(i: int) -> str:
    return (
        "You are a helpful assistant. Answer in full sentences and explain "
        f"your reasoning. Question {i}: why does the sea look blue on a clear "
        "day, and why does it look grey under clouds? Answer:"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", default="8,32,64")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    clients = [int(c) for c in args.clients.split(",")]
    binary = build_example("raw_lockstep")

    async def tokenize() -> list[list[int]]:
        async with await lloyal.create_context(path, n_ctx=256) as ctx:
            return [ctx.tokenize_sync(_prompt(i)) for i in range(max(clients))]

    tokens = asyncio.run(tokenize())
    prompts = Path(f"/tmp/lloyal-kv-streams-{os.getpid()}.json")
    print(
        f"{path.name}: prompts of {min(map(len, tokens))}-{max(map(len, tokens))} tokens, "
        f"{args.steps} steps, {args.threads} threads, best of {args.runs} runs"
    )
    print(f"{'clients':>7} {'unified ms/step':>16} {'split ms/step':>14} {'split / unified':>16}")
    try:
        for c in clients:
            prompts.write_text(json.dumps(tokens[:c]))
            best: dict[str, float] = {}
            for _ in range(args.runs):
                for kv in ("unified", "split"):
                    cmd = [str(binary), str(path), str(prompts), str(args.steps)]
                    out = run_json([*cmd, str(args.threads), str(c), kv])
                    seconds = out["step_seconds"] / args.steps
                    best[kv] = min(best.get(kv, seconds), seconds)
            ratio = best["unified"] / best["split"]
            print(
                f"{c:>7} {best['unified'] * 1e3:16.1f} {best['split'] * 1e3:14.1f} {ratio:15.2f}x"
            )
    finally:
        prompts.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
