"""Prompt lookup speculation in the server's step loop (``lloyal serve
--spec prompt-lookup``): which choices speculate, and their drafting; the
verification is the engine's (``Engine._step``).

A choice that speculates proposes up to ``k`` tokens after the one it just
chose, by finding its last few tokens earlier in its prompt and reply
(:class:`lloyal.strategies.PromptLookup`), and decodes the chosen token and
the drafts in the step's one decode with every position's logits. Each
draft that is the model's own choice after what precedes it is kept and
streamed; the first that is not is replaced by that choice (free, read
from the same logits), and the rest of the drafts are truncated from the
branch. ``k`` adapts: a round drafts one token more than the last one kept
(at most the server's ``k``), so a reply that does not repeat its input
costs little.

Only greedy choices speculate (temperature 0, no penalties, DRY, XTC or
mirostat, no grammar, no reasoning budget, no logprobs): for them the
model's choice is the argmax of its logits (plus the request's
``logit_bias``), so a reply is the tokens it would be without
speculation, up to how logits move with the batch layout (exactly, with
``--deterministic``). Other choices step as before, in the same decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from lloyal.grammar import Grammar
from lloyal.server._protocol import Generation
from lloyal.strategies import PromptLookup


def speculates(gen: Generation, grammar: Grammar | None, budget: bool, default_k: int) -> int:
    """How many drafts a round of this request may verify (0: it does not
    speculate)."""
    p = gen.params
    k = default_k if gen.speculative is None else min(gen.speculative, default_k)
    greedy = (
        p.temperature <= 0
        and p.repeat_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and p.dry_multiplier == 0.0
        and p.xtc_probability == 0.0
        and p.mirostat == 0
    )
    plain = grammar is None and not budget and gen.logprobs is None and not gen.ignore_eos
    return k if greedy and plain else 0


class Drafts:
    """One choice's drafting: its prompt and reply so far, and this round's
    ``k``."""

    def __init__(self, prompt: Sequence[int], k: int, bias: Sequence[tuple[int, float]]) -> None:
        self.prompt = prompt
        self.k_max = self.k = k
        self.lookup = PromptLookup()
        self.bias = dict(bias)

    def propose(self, committed: Sequence[int], pending: int, room: int) -> list[int]:
        """Drafts to follow ``pending`` (the token chosen this step, after
        the prompt and the ``committed`` reply), at most ``room`` (what the
        choice may still make after it)."""
        k = min(self.k, room)
        if k <= 0:
            return []
        return self.lookup.propose([*self.prompt, *committed, pending], k)

    def choice(self, row: npt.NDArray[np.float32]) -> int:
        """The model's greedy choice from a row of logits."""
        if not self.bias:
            return int(np.argmax(row))
        biased = row.astype(np.float64)
        for token, b in self.bias.items():
            biased[token] += b
        return int(np.argmax(biased))
