"""Speculative decoding: acceptance rate and speed-up over plain decoding (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

import lloyal
from lloyal.models import ModelNotInstalledError, default_model_path, smollm2_f16
from lloyal.strategies import PromptLookup, generate, speculative_decode


async def run(
    prompt: str, target_path: str | None, draft_path: str | None, k: int, max_tokens: int, runs: int
) -> None:
    draft_file = draft_path or default_model_path()
    if target_path is None:
        try:
            target_file = smollm2_f16()
        except ModelNotInstalledError as e:
            print(f"({e}; the draft model is the target too)", file=sys.stderr)
            target_file = draft_file
    else:
        target_file = target_path
    async with (
        await lloyal.create_context(target_file, n_ctx=2048, n_seq_max=2) as target,
        await lloyal.create_context(draft_file, n_ctx=2048) as draft,
    ):
        print(f"target {target.model_info.path.name}, draft {draft.model_info.path.name}, k={k}")
        chat = target.format_chat([{"role": "user", "content": prompt}])
        stop = chat.stop_tokens
        # Warm up: page both models' weights in before timing anything.
        await generate(target, chat.prompt, max_tokens=2, stop=stop)
        await generate(draft, chat.prompt, max_tokens=2, stop=stop)
        speeds: dict[str, list[float]] = {"plain": [], "draft model": [], "prompt lookup": []}
        for _ in range(runs):  # alternate the methods so machine noise hits all alike
            plain = await generate(target, chat.prompt, max_tokens=max_tokens, stop=stop)
            spec = await speculative_decode(
                target, chat.prompt, draft=draft, k=k, max_tokens=max_tokens, stop=stop
            )
            look = await speculative_decode(
                target, chat.prompt, draft=PromptLookup(), k=k, max_tokens=max_tokens, stop=stop
            )
            for name, r in (("plain", plain), ("draft model", spec), ("prompt lookup", look)):
                speeds[name].append(r.tokens_per_second)
        print(repr(plain.text))
        base = statistics.median(speeds["plain"])
        print(
            f"\n{'method':<14} {'tok/s':>7} {'speed-up':>9} {'target decodes':>15} "
            f"{'accepted':>9} {'tok/round':>10}  same as greedy"
        )
        print(
            f"{'plain':<14} {base:7.1f} {1.0:8.2f}x {plain.decode_calls:>15} {'-':>9} "
            f"{1.0:10.2f}  -"
        )
        for name, r in (("draft model", spec), ("prompt lookup", look)):
            tps = statistics.median(speeds[name])
            print(
                f"{name:<14} {tps:7.1f} {tps / base:8.2f}x {r.decode_calls:>15} "
                f"{r.acceptance_rate:8.0%} {r.tokens_per_round:10.2f}  "
                f"{'yes' if r.tokens == plain.tokens else 'no'}"
            )
        print(f"\n(medians of {runs} runs; {target.n_threads} threads)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", default="Write a short poem about the sea.")
    parser.add_argument("--target", help="GGUF (default: an F16 copy of SmolLM2, written once)")
    parser.add_argument("--draft", help="GGUF with the same vocabulary (default: SmolLM2 Q4_1)")
    parser.add_argument("-k", type=int, default=4, help="tokens drafted per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(run(args.prompt, args.target, args.draft, args.k, args.max_tokens, args.runs))


if __name__ == "__main__":
    main()
