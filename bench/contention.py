"""Decode speed on a busy machine: lloyal next to llama-cpp-python with 0,
1 and 2 busy processes competing for the cores, and two lloyal contexts
decoding at once in one process.

Each measurement is a child process that loads the model, prefills a short
prompt and times ``--tokens`` greedy steps of 1 branch and of 8 branches
(lloyal: a ``BranchStore`` of 8 forks; llama-cpp-python: 8 sequences in one
``llama_batch`` through its low-level API), every process with as many
threads as the machine has cores -- what each library does by default.
The busy processes are Python busy loops started before the children and
stopped after them. At each load the two libraries take turns,
``--rounds`` times in alternating order; the ratio printed is the median of
the rounds' ratios (lloyal over llama-cpp-python; above 1: lloyal faster),
with their min and max, so the host's noise shows. Both clocks time the
same work: they start after the same warm-up (one token decoded, the cache
cleared) and after the prompt is in every sequence (lloyal prefills once
and forks, the peer prefills every sequence), and stop after the last step.

"Two contexts" runs, in one lloyal process, one context decoding alone and
then two contexts (each with its own worker thread, as two models served
by one process would be) decoding at the same time; the ratio is their
combined tokens per second over the one's.

    python bench/contention.py [--model smollm2] [--tokens 96] [--rounds 3] [--busy 0,1,2]

llama-cpp-python comes from ``~/.cache/lloyal/bench-venv`` (built the first
time: several minutes). Run with nothing else on the machine: the point is
the load this script adds, not a neighbour's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import spread

HERE = Path(__file__).resolve()
PROMPT = "The history of the city begins with a small settlement on the river, where"


def _threads() -> int:
    return os.cpu_count() or 1


# -- children ----------------------------------------------------------------------


def _lloyal_child(model: str, branches: int, tokens: int, contexts: int) -> dict[str, Any]:
    import asyncio

    import lloyal

    async def ready(ctx: lloyal.Context) -> list[lloyal.Branch]:
        prompt = await ctx.tokenize(PROMPT)
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(prompt)
        return [root] + [await root.fork() for _ in range(branches - 1)]

    async def run(ctx: lloyal.Context, forks: list[lloyal.Branch]) -> int:
        store = lloyal.BranchStore(ctx)
        for _ in range(tokens):
            produced = await store.produce(forks)
            await store.commit([(b, p.token) for b, p in zip(forks, produced, strict=True)])
        return tokens * branches

    async def main() -> dict[str, Any]:
        ctxs = [
            await lloyal.create_context(
                model,
                n_ctx=2048,
                n_seq_max=max(branches, 1),
                # None: every core, adapted to the load (docs/performance.md).
                n_threads=int(os.environ.get("LLOYAL_BENCH_THREADS") or 0) or None,
            )
            for _ in range(contexts)
        ]
        try:
            # The peer's warm-up (one token decoded, the cache cleared),
            # then the prompt and the forks: the clock starts after both,
            # as the peer's starts after its prompt.
            for ctx in ctxs:
                first = (await ctx.tokenize(PROMPT))[:1]
                await ctx.decode(first, 0)
                await ctx.kv_cache_clear()
            forks = await asyncio.gather(*(ready(ctx) for ctx in ctxs))
            started = time.perf_counter()
            made = await asyncio.gather(*(run(c, f) for c, f in zip(ctxs, forks, strict=True)))
            seconds = time.perf_counter() - started
            threads = ctxs[0].decode_threads
            for f in forks:
                await f[0].prune_subtree()
        finally:
            for ctx in ctxs:
                await ctx.aclose()
        return {"tokens": sum(made), "seconds": seconds, "threads": threads}

    return asyncio.run(main())


def _llama_cpp_python_child(model: str, branches: int, tokens: int) -> dict[str, Any]:
    import llama_cpp  # type: ignore[import-not-found]
    import numpy as np

    # The low-level API: the high-level Llama has no n_seq_max.
    prompt = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False).tokenize(
        PROMPT.encode()
    )
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    lmodel = llama_cpp.llama_model_load_from_file(model.encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 2048
    cparams.n_batch = 512
    cparams.n_seq_max = branches
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = _threads()
    ctx = llama_cpp.llama_init_from_model(lmodel, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lmodel))
    batch = llama_cpp.llama_batch_init(max(len(prompt) * branches, branches), 0, branches)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
        return int(np.argmax(logits))

    decode([(prompt[0], 0, 0, True)])  # warm up
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    # The prompt in every sequence (one decode), each ending with logits.
    decode([(t, p, s, p == len(prompt) - 1) for s in range(branches) for p, t in enumerate(prompt)])
    last = [argmax((s + 1) * len(prompt) - 1) for s in range(branches)]
    started = time.perf_counter()
    for step in range(tokens):
        decode([(last[s], len(prompt) + step, s, True) for s in range(branches)])
        last = [argmax(s) for s in range(branches)]
    seconds = time.perf_counter() - started
    llama_cpp.llama_batch_free(batch)
    return {"tokens": tokens * branches, "seconds": seconds}


# -- the parent --------------------------------------------------------------------


def _measure(
    python: Path, kind: str, model: Path, branches: int, tokens: int, contexts: int = 1
) -> float:
    cmd = [
        str(python),
        str(HERE),
        "--child",
        kind,
        "--model",
        str(model),
        "--branches",
        str(branches),
        "--tokens",
        str(tokens),
        "--contexts",
        str(contexts),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{kind} failed:\n{out.stderr[-2000:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if "threads" in data:  # lloyal's decode threads at the end, on stderr
        print(f"  {kind}: {data['threads']} decode threads at the end", file=sys.stderr)
    return float(data["tokens"]) / float(data["seconds"])


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", default="0,1,2", help="competing busy processes")
    parser.add_argument("--no-peer", action="store_true", help="lloyal only")
    parser.add_argument(
        "--lloyal-threads", type=int, help="lloyal's threads (default: every core, as the peer's)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--branches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--contexts", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "lloyal":
        print(json.dumps(_lloyal_child(args.model, args.branches, args.tokens, args.contexts)))
        return
    if args.child == "llama-cpp-python":
        print(json.dumps(_llama_cpp_python_child(args.model, args.branches, args.tokens)))
        return

    sys.path.insert(0, str(HERE.parent))
    from _common import llama_cpp_python
    from lloyal.models import model_path

    model = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    if args.lloyal_threads:
        os.environ["LLOYAL_BENCH_THREADS"] = str(args.lloyal_threads)  # the children read it
    peer = None if args.no_peer else llama_cpp_python()
    me = Path(sys.executable)
    loads = [int(b) for b in args.busy.split(",")]
    rows: list[str] = []
    for busy in loads:
        procs = _busy(busy)
        try:
            time.sleep(0.5)
            for branches in (1, 8):
                mine: list[float] = []
                theirs: list[float] = []
                ratios: list[float] = []
                for r in range(args.rounds):
                    order = ["lloyal", "peer"] if r % 2 == 0 else ["peer", "lloyal"]
                    got: dict[str, float] = {}
                    for who in order:
                        if who == "peer" and peer is None:
                            continue
                        python, kind = (
                            (me, "lloyal") if who == "lloyal" else (peer, "llama-cpp-python")
                        )
                        assert python is not None
                        got[who] = _measure(python, kind, model, branches, args.tokens)
                    mine.append(got["lloyal"])
                    if "peer" in got:
                        theirs.append(got["peer"])
                        ratios.append(got["lloyal"] / got["peer"])
                    print(f"busy={busy} branches={branches} round {r}: {got}", file=sys.stderr)
                peer_col = f"{_median(theirs):.1f}" if theirs else "-"
                ratio = spread(ratios) if ratios else "-"
                rows.append(f"| {busy} | {branches} | {_median(mine):.1f} | {peer_col} | {ratio} |")
            alone, two, pair = [], [], []
            for _ in range(args.rounds):
                a = _measure(me, "lloyal", model, 1, args.tokens, contexts=1)
                b = _measure(me, "lloyal", model, 1, args.tokens, contexts=2)
                alone.append(a)
                two.append(b)
                pair.append(b / a)
            rows.append(
                f"| {busy} | two contexts, 1 branch each | {_median(two):.1f} "
                f"| one alone: {_median(alone):.1f} | {spread(pair)} |"
            )
        finally:
            for p in procs:
                p.kill()
                p.wait()
    print(
        f"\nmodel: {model.name}; {args.tokens} greedy steps; {_threads()} threads a process; "
        f"{args.rounds} rounds, taking turns (medians)"
    )
    columns = ["busy processes", "branches", "lloyal tok/s", "llama-cpp-python tok/s"]
    print("\n| " + " | ".join([*columns, "lloyal / peer (min-max)"]) + " |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
