"""Score documents against a query.

Two methods, picked by the context:

- **yes/no** (any instruct model, the default): the model is asked whether
  each document is relevant to the query; the score is the probability it
  puts on "yes" against "no" (over the usual spellings of both). The prompt
  up to the document is decoded once; every document is a fork of it, and
  the documents go through the model together, in one ``llama_decode`` as
  long as their tokens fit ``n_batch`` (and leases allow).
- **embedding** (a context created with ``embeddings=True`` and pooling):
  the cosine similarity of the query's and each document's embedding,
  again batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore
from lloyal.sampling import GREEDY

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["Rerank"]

_SLOT = "\x00DOCUMENT\x00"
_INSTRUCTION = (
    "Judge whether the document is relevant to the query. "
    'Answer only "yes" or "no".\n\nQuery: {query}\n\nDocument: {document}\n\n'
    "Is the document relevant to the query?"
)


class Rerank:
    """Relevance scores of documents for a query, as numpy.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         rerank = lloyal.Rerank(ctx)
    ...         scores = await rerank.score(
    ...             "What is the capital of France?",
    ...             ["Paris is the capital and largest city of France.",
    ...              "Bananas are rich in potassium."],
    ...         )
    ...         return scores.dtype.name, bool(scores[0] > scores[1])
    >>> asyncio.run(main())
    ('float32', True)

    ``method="auto"`` uses embeddings on a pooling (embedding) context and
    the yes/no question otherwise. ``template`` is passed to
    :meth:`Context.format_chat`; ``instruction`` replaces the question
    (it must contain ``{query}`` and ``{document}``).
    """

    def __init__(
        self,
        ctx: Context,
        *,
        method: Literal["auto", "yes_no", "embedding"] = "auto",
        template: str | None = None,
        instruction: str = _INSTRUCTION,
    ) -> None:
        if method not in ("auto", "yes_no", "embedding"):
            raise ValueError(f"method must be 'auto', 'yes_no' or 'embedding', got {method!r}")
        if "{query}" not in instruction or "{document}" not in instruction:
            raise ValueError("instruction must contain {query} and {document}")
        if method == "auto":
            method = "embedding" if ctx.has_pooling else "yes_no"
        if method == "embedding" and not ctx.has_pooling:
            raise ValueError(
                "the embedding method needs a context with embeddings=True and pooling"
            )
        self._ctx = ctx
        self.method = method
        self._template = template
        self._instruction = instruction
        self._yes = self._first_tokens(("yes", "Yes", " yes", " Yes", "YES"))
        self._no = self._first_tokens(("no", "No", " no", " No", "NO"))

    def _first_tokens(self, words: Sequence[str]) -> list[int]:
        ids = {self._ctx.tokenize_sync(w, add_special=False, parse_special=False)[0] for w in words}
        return sorted(ids)

    async def score(self, query: str, documents: Sequence[str]) -> npt.NDArray[np.float32]:
        """One score per document, higher is more relevant: a probability
        of "yes" (yes/no method) or a cosine similarity (embedding)."""
        if not isinstance(query, str) or isinstance(documents, str):
            raise TypeError("score(query: str, documents: list of str)")
        docs = list(documents)
        if not all(isinstance(d, str) for d in docs):
            raise TypeError("documents must be strings")
        if not docs:
            return np.zeros(0, dtype=np.float32)
        if self.method == "embedding":
            rows = await self._ctx.embed([query, *docs])
            sims: npt.NDArray[np.float32] = (rows[1:] @ rows[0]).astype(np.float32)
            return sims
        return await self._yes_no(query, docs)

    async def _yes_no(self, query: str, docs: list[str]) -> npt.NDArray[np.float32]:
        ctx = self._ctx
        text = self._instruction.format(query=query, document=_SLOT)
        prompt = ctx.format_chat(
            [{"role": "user", "content": text}], template=self._template
        ).prompt
        head, sep, tail = prompt.partition(_SLOT)
        if not sep:
            raise ValueError("the chat template dropped the document")
        store = BranchStore(ctx)
        scores = np.empty(len(docs), dtype=np.float32)
        async with Branch.create(ctx, GREEDY) as trunk:
            await trunk.prefill(await ctx.tokenize(head))
            done = 0
            while done < len(docs):
                room = max(1, store.available)
                chunk = docs[done : done + room]
                forks = [await trunk.fork(clone_logits=False) for _ in chunk]
                try:
                    inputs = [await ctx.tokenize(d + tail, add_special=False) for d in chunk]
                    await store.prefill(list(zip(forks, inputs, strict=True)))
                    for i, b in enumerate(forks):
                        scores[done + i] = self._p_yes(b.logits)
                finally:
                    for b in forks:
                        await b.prune()
                done += len(chunk)
        return scores

    def _p_yes(self, logits: npt.NDArray[np.float32]) -> float:
        yes = np.logaddexp.reduce(logits[self._yes].astype(np.float64))
        no = np.logaddexp.reduce(logits[self._no].astype(np.float64))
        return float(1.0 / (1.0 + np.exp(no - yes)))
