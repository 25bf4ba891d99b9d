"""Compare lloyal on a CUDA backend with lloyal on the CPU, same model, same wheel.

Runs each configuration in its own process (llama.cpp's backends are
process-wide), then compares:

- greedy tokens: the flat loop (``decode`` + ``greedy_sample``) and a
  ``BranchStore.commit`` batch of forked branches;
- logits at every step until the first token that differs (max |diff|,
  top-1 agreement);
- teacher-forced perplexity of a fixed text (one token per decode): the
  check that a backend's numbers are right, not merely different;
- speed: prompt processing (one 512-token ``decode``) and generation
  (``decode`` of one token + ``greedy_sample``), in tokens per second.

Configurations: ``cpu`` (the CUDA module not loaded at all, via
LLOYAL_BACKEND_DIR pointing at a copy of the CPU modules), ``ngl0`` (CUDA
loaded, ``n_gpu_layers=0``) and ``gpu`` (``n_gpu_layers=-1``).

    python scripts/cuda_check.py MODEL.gguf --cpu-backend-dir DIR --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

PROMPT = "The three most important inventions in history are"
# Teacher-forced perplexity text: varied prose, so that a model cannot
# predict it from repetition and small numeric differences show up.
PPL_TEXT = (
    "The lighthouse keeper kept a journal for forty years. Most entries were short: "
    "the direction of the wind, the colour of the sea, the ships that passed before "
    "noon. In the winter of the great storm he wrote three pages, describing how the "
    "waves broke over the gallery and how the lamp, which he had trimmed every hour, "
    "never once went dark. Historians later used the journal to date the collapse of "
    "the northern pier, and a biologist counted the seabirds he had listed to show "
    "that the colony had moved south. His granddaughter, who inherited the notebooks, "
    "said she read them not for the weather but for the small remarks in the margins: "
    "a recipe for fish soup, the name of a dog, a complaint about the price of oil, "
    "and once, in careful capitals, the single word THANKS beside the date of a rescue."
)
LONG_TEXT = (
    "Rivers carve valleys over millions of years, carrying sediment from the "
    "mountains to the sea, where deltas slowly grow and shift with the tides. "
)


async def child(model: str, ngl: int, n_gen: int, out: str) -> dict[str, object]:
    import lloyal

    result: dict[str, object] = {"supports_gpu_offload": lloyal.supports_gpu_offload()}
    async with await lloyal.create_context(
        model, n_ctx=2048, n_batch=512, n_seq_max=5, n_gpu_layers=ngl
    ) as ctx:
        # 1. greedy flat loop, logits recorded at every step
        prompt = await ctx.tokenize(PROMPT)
        await ctx.decode(prompt, 0)
        logits = [np.array(ctx.get_logits(), dtype=np.float32)]
        tokens: list[int] = []
        pos = len(prompt)
        for _ in range(n_gen):
            tok = ctx.greedy_sample()
            tokens.append(tok)
            await ctx.decode([tok], pos)
            pos += 1
            logits.append(np.array(ctx.get_logits(), dtype=np.float32))
        result["tokens"] = tokens
        result["text"] = await ctx.detokenize(tokens)
        np.save(os.path.join(out, "logits.npy"), np.stack(logits))

        # 1b. teacher-forced perplexity of PPL_TEXT, one token per decode (the
        #     generation path), from the logits of every position
        await ctx.kv_cache_clear()
        text = await ctx.tokenize(PPL_TEXT)
        nll = []
        for i, tok in enumerate(text[:-1]):
            await ctx.decode([tok], i)
            row = np.array(ctx.get_logits(), dtype=np.float64)
            m = row.max()
            nll.append(m + np.log(np.exp(row - m).sum()) - row[text[i + 1]])
        result["ppl_tokens"] = len(nll)
        result["ppl"] = float(np.exp(np.mean(nll)))

        # 2. branches: fork 4 greedy branches that diverge by a forced first
        #    token, then commit them together (one llama_decode per step)
        await ctx.kv_cache_clear()
        store = lloyal.BranchStore(ctx)
        root = lloyal.Branch.create(ctx, params=lloyal.SamplingParams(temperature=0))
        await root.prefill(prompt)
        first = list(np.argsort(-np.asarray(root.logits))[:4])
        branches = [await root.fork() for _ in first]
        await store.commit([(b, int(t)) for b, t in zip(branches, first, strict=True)])
        seqs: list[list[int]] = [[int(t)] for t in first]
        for _ in range(15):
            produced = [await b.produce() for b in branches]
            await store.commit([(b, p.token) for b, p in zip(branches, produced, strict=True)])
            for s, p in zip(seqs, produced, strict=True):
                s.append(p.token)
        result["branch_tokens"] = seqs
        for b in branches:
            await b.prune()
        await root.prune()

        # 3. speed: warm up, then time prompt processing and generation
        await ctx.kv_cache_clear()
        long_prompt = (await ctx.tokenize(LONG_TEXT * 40))[:512]
        pp = []
        for _ in range(4):
            await ctx.kv_cache_clear()
            t0 = time.perf_counter()
            await ctx.decode(long_prompt, 0)
            ctx.get_logits()
            pp.append(time.perf_counter() - t0)
        result["pp_tokens"] = len(long_prompt)
        result["pp_tok_s"] = len(long_prompt) / min(pp[1:])
        tg = []
        for _ in range(3):
            await ctx.kv_cache_clear()
            await ctx.decode(prompt, 0)
            pos = len(prompt)
            n = 128
            t0 = time.perf_counter()
            for _ in range(n):
                tok = ctx.greedy_sample()
                await ctx.decode([tok], pos)
                pos += 1
            tg.append(time.perf_counter() - t0)
        result["tg_tokens"] = 128
        result["tg_tok_s"] = 128 / min(tg[1:])
    return result


def spawn(name: str, args: argparse.Namespace, ngl: int, env: dict[str, str]) -> dict:
    out = os.path.join(args.out, name)
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, __file__, args.model, "--child", str(ngl), "--n-gen", str(args.n_gen)]
    cmd += ["--out", out]
    with open(os.path.join(args.out, f"{name}.log"), "w") as log:
        env = {**os.environ, **env, "LLOYAL_LOG": "1"}
        rc = subprocess.run(cmd, env=env, stderr=log).returncode
    if rc != 0:
        raise SystemExit(f"{name}: child failed with {rc}; see {name}.log")
    with open(os.path.join(out, "result.json")) as f:
        res = json.load(f)
    res["logits"] = np.load(os.path.join(out, "logits.npy"))
    return res


def compare(a: dict, b: dict) -> dict:
    ta, tb = a["tokens"], b["tokens"]
    same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
    # logits rows 0..same are computed from identical token histories
    la, lb = a["logits"][: same + 1], b["logits"][: same + 1]
    diff = np.abs(la - lb)
    scale = np.abs(la).max(axis=1)
    top1 = float(np.mean(la.argmax(axis=1) == lb.argmax(axis=1)))
    return {
        "greedy_tokens_equal": ta == tb,
        "first_differing_step": None if ta == tb else same,
        "branch_tokens_equal": a["branch_tokens"] == b["branch_tokens"],
        "logits_rows_compared": int(la.shape[0]),
        "logits_max_abs_diff": float(diff.max()),
        "logits_max_rel_diff": float((diff.max(axis=1) / scale).max()),
        "logits_top1_agreement": top1,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--cpu-backend-dir", help="a directory holding only libggml-cpu*.so")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.child is not None:
        result = asyncio.run(child(args.model, args.child, args.n_gen, args.out))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
        return
    runs = {}
    if args.cpu_backend_dir:
        runs["cpu"] = spawn("cpu", args, 0, {"LLOYAL_BACKEND_DIR": args.cpu_backend_dir})
    runs["ngl0"] = spawn("ngl0", args, 0, {})
    runs["gpu"] = spawn("gpu", args, -1, {})
    base = runs.get("cpu", runs["ngl0"])
    summary: dict[str, object] = {"model": os.path.basename(args.model), "n_gen": args.n_gen}
    for name, r in runs.items():
        keys = ("supports_gpu_offload", "ppl", "ppl_tokens", "pp_tok_s", "tg_tok_s", "text")
        summary[name] = {k: r[k] for k in keys}
        if r is not base:
            summary[f"{name}_vs_{'cpu' if 'cpu' in runs else 'ngl0'}"] = compare(base, r)
    print(json.dumps(summary, indent=1))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
