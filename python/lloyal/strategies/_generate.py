""":func:`generate`: the plain decoding loop, the baseline the other
strategies are measured against."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from lloyal._generation import Generation
from lloyal.branch import Branch
from lloyal.context import Context
from lloyal.sampling import GREEDY, SamplingParams
from lloyal.strategies._common import (
    Continuation,
    Prompt,
    _check_positive,
    _Output,
    _prompt_tokens,
    _prune_all,
    _Recorder,
)


@dataclass(frozen=True)
class Generated(_Output):
    """What :func:`generate` returns."""

    output: Continuation
    decode_calls: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return len(self.output.tokens) / self.seconds if self.seconds > 0 else math.inf


async def generate(
    ctx: Context,
    prompt: Prompt,
    *,
    max_tokens: int = 64,
    params: SamplingParams = GREEDY,
    stop: Iterable[int] = (),
) -> Generated:
    """Generate on one branch until a stop token or ``max_tokens``.

    The plain decoding loop (one ``llama_decode`` per token), with the
    per-token numbers the other strategies report: the baseline to compare
    them with. ``stop`` adds stop tokens to the model's own (e.g. a chat
    template's ``stop_tokens``). Needs one free KV lease.

    >>> import asyncio, lloyal
    >>> from lloyal.strategies import generate
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         return await generate(ctx, "The capital of France is", max_tokens=1)
    >>> result = asyncio.run(main())
    >>> result.text, len(result.output.surprisals), result.decode_calls
    (' Paris', 1, 1)
    """
    _check_positive(max_tokens=max_tokens)
    tokens = await _prompt_tokens(ctx, prompt)
    gen = Generation(ctx, max_tokens=max_tokens, stop_tokens=frozenset(int(t) for t in stop))
    calls, started = ctx.stats.decode_calls, time.perf_counter()
    rec = _Recorder()
    branch = Branch.create(ctx, params=params)
    try:
        await branch.prefill(tokens)
        while gen.finish is None:
            p = await branch.produce()
            step = gen.feed(p.token, p.is_stop)
            if step.token is None:
                rec.stopped = True
                break
            # The numbers read the logits the token was chosen from.
            rec.add(step.token, branch.model_surprisal(step.token), branch.model_entropy())
            if step.finish is None:  # the last token is never decoded
                await branch.commit(step.token)
    finally:
        await _prune_all(branch)
    out = await rec.finish(ctx)
    return Generated(out, ctx.stats.decode_calls - calls, time.perf_counter() - started)
