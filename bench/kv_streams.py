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
prefilled together, then ``--steps`` lockstep greedy steps, in four
layouts taking turns:

- ``unified``: unified KV, one decode a step, upstream's attention kernel
  (the project's patch switched off for the run);
- ``unified63``: the same in decodes of at most 63 tokens (what lloyal's
  worker did before the patch);
- ``split``: one KV stream per sequence, upstream's kernel (llama-server's
  slots);
- ``patched``: unified KV, one decode a step, with the project's flash
  attention patch (patches/llama.cpp/0001-*: each row reads only the cells
  it may see). This is what lloyal runs.

Printed per C: milliseconds per step (best of ``--runs``, and min/median/max
over the runs of each layout so the host's noise shows), and each unified
layout's speed as a fraction of split KV's (>= 1.0: as fast as split).

Then one sequence, where the patch must cost nothing: a ``--one``-token
prompt prefilled in one decode (the tiled kernel's causal rows), then
``--steps`` single-token decodes over its cells (the kernel that splits
them among threads), patched and upstream taking turns; the ratio is
upstream's time over the patch's (>= 1.0: the patch is no slower).

    python bench/kv_streams.py [--model smollm2|gemma3|PATH] [--clients 8,32,64,128]
                               [--steps 128] [--runs 2] [--layouts unified,unified63,split,patched]
                               [--one 512]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import median, raw_lockstep
from lloyal.models import model_path


def _prompt(i: int) -> str:
    return (
        "You are a helpful assistant. Answer in full sentences and explain "
        f"your reasoning. Question {i}: why does the sea look blue on a clear "
        "day, and why does it look grey under clouds? Answer:"
    )


LAYOUTS = {
    # name: (raw_lockstep's KV argument, upstream attention)
    "unified": ("unified", True),
    "unified63": ("unified63", True),
    "split": ("split", True),
    "patched": ("unified", False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", default="8,32,64,128")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--one", type=int, default=512, help="one sequence's prompt (0: skip)")
    args = parser.parse_args()
    path = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    clients = [int(c) for c in args.clients.split(",")]
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown or "split" not in layouts:
        parser.error(f"--layouts: names from {sorted(LAYOUTS)}, split among them")

    async def tokenize() -> list[list[int]]:
        # enough prompts for the one-sequence prompt too (~40 tokens each)
        n = max(max(clients), args.one // 30 + 1)
        async with await lloyal.create_context(path, n_ctx=256) as ctx:
            return [ctx.tokenize_sync(_prompt(i)) for i in range(n)]

    tokens = asyncio.run(tokenize())
    print(
        f"{path.name}: prompts of {min(map(len, tokens))}-{max(map(len, tokens))} tokens, "
        f"{args.steps} steps, {args.threads} threads, {args.runs} runs a layout, layouts in turn"
    )
    others = [name for name in layouts if name != "split"]
    print("ms per step (best; min/median/max over runs), and speed as a fraction of split KV's:")
    print(
        f"{'clients':>7} "
        + " ".join(f"{name:>24}" for name in layouts)
        + "  "
        + " ".join(f"{name + '/split':>16}" for name in others)
    )
    for c in clients:
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.runs):
            for name in layouts:
                kv, upstream = LAYOUTS[name]
                out = raw_lockstep(path, tokens[:c], args.steps, args.threads, c, kv, upstream)
                times[name].append(out["step_seconds"] / args.steps * 1e3)
        cells = []
        for name in layouts:
            t = times[name]
            cells.append(f"{min(t):7.1f} ({min(t):.0f}/{median(t):.0f}/{max(t):.0f})".rjust(24))
        ratios = [f"{min(times['split']) / min(times[name]):15.2f}x" for name in others]
        print(f"{c:>7} " + " ".join(cells) + "  " + " ".join(ratios), flush=True)
    if args.one:
        one_sequence(path, tokens, args)


def one_sequence(path: Path, tokens: list[list[int]], args: argparse.Namespace) -> None:
    """One prompt of ``args.one`` tokens and ``args.steps`` decodes, with the
    patch and without, taking turns."""
    prompt = [t for p in tokens for t in p][: args.one]
    got: dict[str, dict[str, list[float]]] = {
        name: {"prefill": [], "decode": []} for name in ("upstream", "patched")
    }
    for _ in range(max(args.runs, 3)):
        for name in got:
            out = raw_lockstep(
                path, [prompt], args.steps, args.threads, 1, "unified", name == "upstream"
            )
            got[name]["prefill"].append(out["prefill_seconds"] * 1e3)
            got[name]["decode"].append(out["step_seconds"] / args.steps * 1e3)
    print(
        f"one sequence: {len(prompt)}-token prompt in one decode, then {args.steps} decodes "
        "(ms; min/median/max; upstream/patched >= 1.0: the patch is no slower)"
    )
    for what in ("prefill", "decode"):
        up, pa = got["upstream"][what], got["patched"][what]
        print(
            f"  {what:>7}: upstream {min(up):.1f} ({min(up):.1f}/{median(up):.1f}/{max(up):.1f})"
            f"  patched {min(pa):.1f} ({min(pa):.1f}/{median(pa):.1f}/{max(pa):.1f})"
            f"  upstream/patched {min(up) / min(pa):.2f}x (medians {median(up) / median(pa):.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
