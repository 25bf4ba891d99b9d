"""Prompt lookup speculation in the server's step loop (``lloyal serve
--spec prompt-lookup``): which choices speculate, and their drafting; the
verification is the engine's (``Scheduler._step``).

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

from lloyal.branch import Branch
from lloyal.context import Context
from lloyal.errors import NoLeaseError
from lloyal.grammar import Grammar
from lloyal.media import has_media
from lloyal.sampling import GREEDY
from lloyal.server._protocol import RequestOptions
from lloyal.strategies import PromptLookup
from lloyal.strategies._speculative import _common_prefix, _same_vocabulary


def speculates(gen: RequestOptions, grammar: Grammar | None, budget: bool, default_k: int) -> int:
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


def drafting(
    prompt: list[int],
    gen: RequestOptions,
    grammar: Grammar | None,
    budget: bool,
    default_k: int,
    draft: Context | None,
) -> Drafts | None:
    """The drafting of one choice of a request, if it speculates: prompt
    lookup, or the draft model (``draft``) where the prompt has no media."""
    k = speculates(gen, grammar, budget, default_k)
    if not k:
        return None
    if draft is None:
        return Drafts(prompt, k, gen.params.logit_bias)
    if has_media(prompt):
        return None
    return ModelDrafts(prompt, k, gen.params.logit_bias, draft)


class Drafts:
    """One choice's drafting: its prompt and reply so far, and this round's
    ``k``."""

    def __init__(self, prompt: Sequence[int], k: int, bias: Sequence[tuple[int, float]]) -> None:
        self.prompt = prompt
        self.k_max = self.k = k
        self.lookup = PromptLookup()
        self.bias = dict(bias)

    async def propose(self, committed: Sequence[int], pending: int, room: int) -> list[int]:
        """Drafts to follow ``pending`` (the token chosen this step, after
        the prompt and the ``committed`` reply), at most ``room`` (what the
        choice may still make after it)."""
        k = min(self.k, room)
        if k <= 0:
            return []
        return self.lookup.propose([*self.prompt, *committed, pending], k)

    async def aclose(self) -> None:
        """Give back what drafting holds (nothing, for prompt lookup)."""

    def choice(self, row: npt.NDArray[np.float32]) -> int:
        """The model's greedy choice from a row of logits."""
        if not self.bias:
            return int(np.argmax(row))
        biased = row.astype(np.float64)
        for token, b in self.bias.items():
            biased[token] += b
        return int(np.argmax(biased))


class ModelDrafts(Drafts):
    """Drafting with a draft model (``--model-draft``): a branch of the
    draft context per choice, holding the prompt and reply; each round it
    catches up on what was committed (truncating what was rejected), then
    writes its greedy continuation. The rounds of several choices decode
    together (the draft context's step scheduler)."""

    def __init__(
        self,
        prompt: Sequence[int],
        k: int,
        bias: Sequence[tuple[int, float]],
        draft: Context,
    ) -> None:
        super().__init__(prompt, k, bias)
        self.draft = draft
        self.branch: Branch | None = None
        self.held: list[int] = []  # the tokens the branch holds

    async def propose(self, committed: Sequence[int], pending: int, room: int) -> list[int]:
        k = min(self.k, room)
        if k <= 0:
            return []
        history = [*self.prompt, *committed, pending]
        if self.branch is None:
            try:
                self.branch = Branch.create(self.draft, GREEDY)
            except NoLeaseError:
                return []  # the draft context is full: no drafts this round
        common = _common_prefix(self.held, history)
        # Decode at least the last token again: its logits start the draft.
        keep = min(common, len(history) - 1)
        if keep < len(self.held):
            await self.branch.truncate(keep)
        self.held = history[:keep]
        await self.branch.prefill(history[keep:])
        self.held = history
        guesses: list[int] = []
        for i in range(k):
            p = await self.branch.produce()
            guesses.append(p.token)
            if i + 1 == k or p.is_stop:
                break
            await self.branch.prefill([p.token])
            self.held.append(p.token)
        return guesses

    async def aclose(self) -> None:
        if self.branch is not None and not self.branch.disposed:
            await self.branch.prune()
        self.branch = None


def check_draft(target: Context, draft: Context) -> None:
    """Refuse a draft model whose vocabulary is not the target's."""
    if not _same_vocabulary(target, draft):
        raise ValueError("the draft model's vocabulary is not the model's: it cannot draft for it")
