"""Unified KV against one KV stream per sequence, in plain llama.cpp.

lloyal runs llama.cpp with a unified KV cache: every sequence's cells sit
in one pool, which is what lets a fork share its parent's cells. The
price is in attention: each token's attention scans every used cell of
the pool (the ones of other sequences are masked, but still visited), so
with C sequences of L cells each a decode does work in C * L per token.
llama-server runs its slots with ``kv_unified`` off: one stream of cells
per sequence, each token scanning only its own.

On the CPU the price has a step at 64 tokens a decode: from there
llama.cpp's flash attention runs a tiled kernel that computes every KV
tile some token of a 64-token block may see (for 64 sequences, about
every cell), where below 64 another kernel skips each cell a token may not
see. lloyal's worker therefore decodes many commits in decodes of at most
63 tokens when attention dominates (docs/batching.md, "Many sequences").

This measures all of it with no lloyal code in the loop
(``examples/raw_lockstep.rs``): C distinct prompts of a server-like length
prefilled together, then ``--steps`` lockstep greedy steps, in three
layouts taking turns: unified KV with one decode a step, unified KV in
decodes of at most 63 tokens (what lloyal does), and split KV with one
decode a step. Printed per C: milliseconds per step in each, and how much
faster split KV is than each unified layout.

    python bench/kv_streams.py [--model smollm2|gemma3|PATH] [--clients 8,32,64]
                               [--steps 128] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import raw_lockstep
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

    async def tokenize() -> list[list[int]]:
        async with await lloyal.create_context(path, n_ctx=256) as ctx:
            return [ctx.tokenize_sync(_prompt(i)) for i in range(max(clients))]

    tokens = asyncio.run(tokenize())
    print(
        f"{path.name}: prompts of {min(map(len, tokens))}-{max(map(len, tokens))} tokens, "
        f"{args.steps} steps, {args.threads} threads, best of {args.runs} runs"
    )
    print("ms per step, and how much faster split KV is than each unified layout:")
    print(
        f"{'clients':>7} {'unified':>9} {'unified63':>10} {'split':>7}"
        f" {'split/unified':>14} {'split/unified63':>16}"
    )
    for c in clients:
        best: dict[str, float] = {}
        for _ in range(args.runs):
            for kv in ("unified", "unified63", "split"):
                out = raw_lockstep(path, tokens[:c], args.steps, args.threads, c, kv)
                seconds = out["step_seconds"] / args.steps
                best[kv] = min(best.get(kv, seconds), seconds)
        ms = {kv: seconds * 1e3 for kv, seconds in best.items()}
        print(
            f"{c:>7} {ms['unified']:9.1f} {ms['unified63']:10.1f} {ms['split']:7.1f}"
            f" {ms['unified'] / ms['split']:13.2f}x {ms['unified63'] / ms['split']:15.2f}x"
        )


if __name__ == "__main__":
    main()
