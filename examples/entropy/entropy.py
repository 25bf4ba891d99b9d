"""Entropy as control flow: retrieve when the model is guessing (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import re

import lloyal
from lloyal.models import default_model_path

# A stand-in for a search index: retrieval picks the note sharing the most
# words with the question and the answer so far.
NOTES = [
    "The Danube flows through ten countries and ends in the Black Sea.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa, 5,895 metres.",
    "The Atacama in Chile is the driest non-polar desert on Earth.",
    "Lake Baikal in Siberia is the deepest lake in the world, 1,642 metres.",
]


def retrieve(text: str) -> str:
    words = set(re.findall(r"\w+", text.lower()))
    return max(NOTES, key=lambda n: len(words & set(re.findall(r"\w+", n.lower()))))


async def run(question: str, model: str | None, threshold: float, max_tokens: int) -> None:
    async with await lloyal.create_context(model or default_model_path(), n_ctx=2048) as ctx:
        chat = ctx.format_chat([{"role": "user", "content": question}])
        tokens = await ctx.tokenize(chat.prompt)
        await ctx.decode(tokens, 0)
        pos, answer, stream = len(tokens), [], lloyal.TextStream(ctx)
        retrieved, entropies = False, []
        params = lloyal.SamplingParams(temperature=0.7, seed=0)
        for _ in range(max_tokens):
            entropy = ctx.model_entropy("bits")
            entropies.append(entropy)
            if entropy > threshold and not retrieved:
                # The model is guessing: put a retrieved note into the context
                # and let it continue from there (once per answer).
                retrieved = True
                note = retrieve(question + " " + "".join(answer))
                print(f"\n[entropy {entropy:.1f} bits > {threshold}: retrieved {note!r}]\n")
                extra = await ctx.tokenize(f" (Note: {note})", add_special=False)
                await ctx.decode(extra, pos)
                pos += len(extra)
                continue
            # Confident: sample cooler; unsure but below the threshold: as is.
            token = ctx.sample(params.with_(temperature=0.3) if entropy < 1.0 else params)
            if token in chat.stop_tokens or ctx.is_stop_token(token):
                break
            answer.append(stream.push(token))
            print(answer[-1], end="", flush=True)
            await ctx.decode([token], pos)
            pos += 1
        print(stream.flush())
        high = sum(e > threshold for e in entropies)
        print(
            f"\n[{len(entropies)} steps, mean entropy {sum(entropies) / len(entropies):.2f} bits, "
            f"{high} above {threshold} bits, retrieval {'used' if retrieved else 'not needed'}]"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("question", nargs="?", default="How deep is Lake Baikal?")
    parser.add_argument("--model")
    parser.add_argument("--threshold", type=float, default=3.0, help="bits")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(run(args.question, args.model, args.threshold, args.max_tokens))


if __name__ == "__main__":
    main()
