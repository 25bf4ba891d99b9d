"""Speculative decoding against plain decoding, side by side in one run.

For each model and task it runs, alternating, `repeats` times each:
plain greedy decoding (`strategies.generate`), speculation with a draft
model, tree speculation (the draft's top 3 at positions where it is less
than 80% sure, verified in the same decode) and prompt lookup (n-gram
drafts from the prompt). For SmolLM2 the
target is its F16 copy (`lloyal.models.smollm2_f16`, needs `pip install
gguf`) and the draft the Q4_1 file; otherwise, and for Gemma 3, the model
drafts for itself (a second context), which only checks acceptance.
Tasks: "echo" (rewrite a paragraph given in the prompt, where lookup
finds long matches) and "free" (a short poem). It
prints acceptance, target decodes, tokens verified per decode, output
tokens per target decode and the speed-up over plain decoding (median
wall time), and, for the arithmetic,
what a decode of k + 1 tokens costs against a decode of one.

    python bench/speculative.py [--models smollm2,gemma3] [--k 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import median
from lloyal import strategies
from lloyal.models import ModelNotInstalledError, model_path, smollm2_f16

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. "
    "He wound the clockwork, trimmed the wick and polished the great lens "
    "until it shone, then sat by the window and watched the ships pass."
)
# (user message, start of the assistant's reply)
TASKS = {
    "echo": (f"Copy this paragraph word for word:\n\n{PARAGRAPH}", PARAGRAPH[:40]),
    "free": ("Write a short poem about the sea.", ""),
}


async def decode_cost(ctx: lloyal.Context, k: int, repeats: int = 20) -> float:
    """Seconds of a (k+1)-token decode over a 1-token decode, same position."""
    prompt = await ctx.tokenize(PARAGRAPH)
    b = lloyal.Branch.create(ctx, lloyal.GREEDY)
    await b.prefill(prompt)
    base = b.position
    extra = prompt[: k + 1]
    one: list[float] = []
    many: list[float] = []
    for _ in range(repeats):
        for n, out in ((1, one), (k + 1, many)):
            t = time.perf_counter()
            await b.prefill(extra[:n])
            out.append(time.perf_counter() - t)
            await b.truncate(base)
    await b.prune()
    return median(many) / median(one)


async def bench_model(name: str, k: int, tokens: int, repeats: int) -> None:
    draft_path = target_path = model_path(name)
    draft_label = "self-draft"
    if name == "smollm2":
        try:
            target_path, draft_label = smollm2_f16(), "Q4_1 draft"
        except ModelNotInstalledError as e:
            print(f"({e}: SmolLM2 drafts for itself)")
    async with (
        await lloyal.create_context(target_path, n_ctx=1024, n_seq_max=8) as target,
        await lloyal.create_context(draft_path, n_ctx=1024) as draft,
    ):
        ratio = await decode_cost(target, k)
        print(
            f"\n{name}: target {target_path.name}, draft {draft_path.name}, k={k}: "
            f"a {k + 1}-token target decode costs {ratio:.2f}x a 1-token one"
        )
        for task, (text, reply_start) in TASKS.items():
            template = None if target.model_info.has_chat_template else "gemma"
            chat = target.format_chat([{"role": "user", "content": text}], template=template)
            prompt = chat.prompt + reply_start
            drafters: dict[str, dict[str, object]] = {
                draft_label: {"draft": draft},
                "tree": {"draft": draft, "width": 3, "confidence": 0.8},
                "lookup": {"draft": strategies.PromptLookup()},
            }
            runs: dict[str, list[float]] = {"plain": [], **{label: [] for label in drafters}}
            last: dict[str, strategies.Speculative] = {}
            plain_tokens: tuple[int, ...] = ()
            for _ in range(repeats):
                g = await strategies.generate(target, prompt, max_tokens=tokens)
                runs["plain"].append(g.seconds)
                plain_tokens = g.tokens
                for label, options in drafters.items():
                    s = await strategies.speculative_decode(
                        target,
                        prompt,
                        k=k,
                        max_tokens=tokens,
                        **options,  # type: ignore[arg-type]
                    )
                    runs[label].append(s.seconds)
                    last[label] = s
            plain = median(runs["plain"])
            print(f"  {task}: plain {len(plain_tokens)} tokens, {plain * 1e3:.0f} ms")
            for label, s in last.items():
                same = "same text" if s.tokens == plain_tokens else "DIFFERENT text"
                print(
                    f"    {label:10} accepted {s.acceptance_rate:4.0%}  "
                    f"{s.rounds:3d} target decodes  {s.verified / s.rounds:4.1f} verified/decode  "
                    f"{s.tokens_per_round:4.2f} tok/decode  "
                    f"speed-up {plain / median(runs[label]):4.2f}x  ({same})"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in args.models.split(","):
        asyncio.run(bench_model(name, args.k, args.tokens, args.repeats))


if __name__ == "__main__":
    main()
