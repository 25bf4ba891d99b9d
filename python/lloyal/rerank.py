"""Score documents against a query.

Three methods:

- **likelihood** (any generative model, base or instruct; the default):
  how likely the model finds the query after the document, the mean
  log-probability of the query's tokens (query likelihood, as in UPR,
  Sachan et al. 2022). The documents are decoded together, then the query
  after each of them together, with every position's logits: a fixed
  number of ``llama_decode`` calls however many documents (3 when they
  fit ``n_batch``, the leases and the logits budget), and no text is
  generated. Scores are log-probabilities (negative; higher is better).
- **yes_no** (instruct models): the model is asked, through its chat
  template, whether each document is relevant, and the score is the
  probability it puts on "yes" against "no" (over their usual spellings).
  The question up to the document is decoded once and every document is a
  fork of it, decoded together. Larger instruct models judge well this
  way; models of a few hundred million parameters barely do (on the test
  models the scores hardly separate), which is why it is not the default.
- **embedding** (a context created with ``embeddings=True`` and pooling):
  the cosine similarity of the query's and each document's embedding.
- **rank** (a reranker -- a cross-encoder with a classification head --
  opened with ``embeddings=True, pooling="rank"``): the model's own score
  of each query-document pair, all pairs in as few decodes as ``n_batch``
  allows. A pair is the GGUF's ``tokenizer.chat_template.rerank`` with
  ``{query}`` and ``{document}`` filled in (Qwen3-Reranker), else the
  query and the document each with the model's special tokens, the
  document's leading BOS dropped (``[CLS] query [SEP] document [SEP]``
  for BERT rerankers). The score is the head's first output (for
  Qwen3-Reranker, P(yes)).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from lloyal.branch import Branch, BranchStore
from lloyal.errors import KVCacheFullError
from lloyal.sampling import GREEDY

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["Rerank"]

Method = Literal["auto", "likelihood", "yes_no", "embedding", "rank"]

_SLOT = "\x00DOCUMENT\x00"
_INSTRUCTION = (
    "Judge whether the document is relevant to the query. "
    'Answer only "yes" or "no".\n\nQuery: {query}\n\nDocument: {document}\n\n'
    "Is the document relevant to the query?"
)
_LIKELIHOOD = "Passage: {document}\nA question this passage answers: {query}"
# The per-position logits the likelihood method holds at once (the
# documents go in chunks that stay under it).
_ROWS_BUDGET = 64 << 20


class Rerank:
    """Relevance scores of documents for a query, as numpy.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         rerank = lloyal.Rerank(ctx)
    ...         scores = await rerank.score(
    ...             "What is the capital of France?",
    ...             ["The capital of France is Paris.",
    ...              "Bananas are yellow fruit."],
    ...         )
    ...         return rerank.method, scores.dtype.name, bool(scores[0] > scores[1])
    >>> asyncio.run(main())
    ('likelihood', 'float32', True)

    ``method="auto"`` uses a reranker's scores on a rank context,
    embeddings on a pooling (embedding) context and the query likelihood
    otherwise (see the module docs). ``prompt``
    replaces the text the method builds around the query and document: it
    must contain ``{query}`` and ``{document}`` (for ``likelihood``, the
    query last). ``template`` is the chat template of ``yes_no``
    (:meth:`Context.format_chat`).

    An empty (or all-space) query is a ``ValueError``. Documents that do
    not fit the KV cache together are scored in parts that do; one that
    does not fit alone raises :class:`KVCacheFullError`.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        method: Method = "auto",
        template: str | None = None,
        prompt: str | None = None,
    ) -> None:
        if method not in ("auto", "likelihood", "yes_no", "embedding", "rank"):
            raise ValueError(
                "method must be 'auto', 'likelihood', 'yes_no', 'embedding' or 'rank', "
                f"got {method!r}"
            )
        if method == "auto":
            method = "rank" if ctx.ranks else "embedding" if ctx.has_pooling else "likelihood"
        if (method == "rank") != ctx.ranks:
            raise ValueError(
                'the rank method is for a reranker context (embeddings=True, pooling="rank"), '
                "and such a context takes only it"
            )
        if method == "embedding" and not ctx.has_pooling:
            raise ValueError(
                "the embedding method needs a context with embeddings=True and pooling"
            )
        if method != "embedding" and ctx.has_pooling:
            raise ValueError(f"the {method} method needs a generative context (no pooling)")
        text = prompt if prompt is not None else _INSTRUCTION if method == "yes_no" else _LIKELIHOOD
        if "{query}" not in text or "{document}" not in text:
            raise ValueError("prompt must contain {query} and {document}")
        if method == "likelihood" and not text.rstrip().endswith("{query}"):
            raise ValueError("the likelihood prompt must end with {query}")
        self._ctx = ctx
        self.method: Literal["likelihood", "yes_no", "embedding", "rank"] = method
        self._template = template
        self._prompt = text
        if method == "yes_no":
            self._yes = self._first_tokens(("yes", "Yes", " yes", " Yes", "YES"))
            self._no = self._first_tokens(("no", "No", " no", " No", "NO"))

    def _first_tokens(self, words: Sequence[str]) -> list[int]:
        ids = {self._ctx.tokenize_sync(w, add_special=False, parse_special=False)[0] for w in words}
        return sorted(ids)

    async def score(self, query: str, documents: Sequence[str]) -> npt.NDArray[np.float32]:
        """One score per document, higher is more relevant: a mean
        log-probability (likelihood), a probability of "yes" (yes_no) or a
        cosine similarity (embedding)."""
        if not isinstance(query, str) or isinstance(documents, str):
            raise TypeError("score(query: str, documents: list of str)")
        docs = list(documents)
        if not all(isinstance(d, str) for d in docs):
            raise TypeError("documents must be strings")
        if not docs:
            return np.zeros(0, dtype=np.float32)
        if not query.strip():
            raise ValueError("the query is empty")
        if self.method == "rank":
            pairs = [await self.pair(query, d) for d in docs]
            return (await self._ctx.embed_tokens(pairs, normalize=False))[:, 0].copy()
        if self.method == "embedding":
            rows = await self._ctx.embed([query, *docs])
            sims: npt.NDArray[np.float32] = (rows[1:] @ rows[0]).astype(np.float32)
            return sims
        if self.method == "yes_no":
            return await self._yes_no(query, docs)
        return await self._likelihood(query, docs)

    async def pair(self, query: str, document: str) -> list[int]:
        """The tokens of a query-document pair as a reranker reads them
        (``method="rank"``; see the module docs)."""
        ctx = self._ctx
        template = ctx.metadata("tokenizer.chat_template.rerank")
        if template:
            text = template.replace("{query}", query).replace("{document}", document)
            return await ctx.tokenize(text, parse_special=True)
        doc = await ctx.tokenize(document)
        if doc and doc[0] == ctx.bos_token:
            doc = doc[1:]
        return [*await ctx.tokenize(query), *doc]

    def _chunks(self, docs: list[str], per_doc_bytes: int) -> list[list[int]]:
        """Document indices in groups that fit the free leases (the trunk
        holds one already) and the logits budget."""
        room = max(1, BranchStore(self._ctx).available)
        room = min(room, max(1, _ROWS_BUDGET // max(1, per_doc_bytes)))
        return [list(range(i, min(i + room, len(docs)))) for i in range(0, len(docs), room)]

    async def _likelihood(self, query: str, docs: list[str]) -> npt.NDArray[np.float32]:
        ctx = self._ctx
        head, _, middle = self._prompt.partition("{document}")
        middle = middle[: middle.rindex("{query}")].replace("{query}", query)
        # A space before the query goes with it, as the tokenizer would put it.
        spaced = middle.endswith(" ")
        middle = middle.removesuffix(" ")
        asked = await ctx.tokenize(" " + query if spaced else query, add_special=False)
        if not asked:
            raise ValueError("the query is empty")
        store = BranchStore(ctx)
        scores = np.empty(len(docs), dtype=np.float32)
        async with Branch.create(ctx, GREEDY) as trunk:
            # A prompt that starts with the document has no head to decode.
            head_tokens = await ctx.tokenize(head.replace("{query}", query))
            if head_tokens:
                await trunk.prefill(head_tokens)

            async def one(chunk: list[int]) -> None:
                forks = [await trunk.fork(clone_logits=False) for _ in chunk]
                try:
                    inputs = [
                        await ctx.tokenize(docs[i] + middle, add_special=False) for i in chunk
                    ]
                    await store.prefill(list(zip(forks, inputs, strict=True)))
                    # The first query token from each snapshot, the rest
                    # from the rows of one more decode.
                    firsts = [float(b.logprobs(asked[:1])[0]) for b in forks]
                    rest = [0.0] * len(forks)
                    if len(asked) > 1:
                        rows = await store.prefill([(b, asked[:-1]) for b in forks], logits="all")
                        rest = [_logprob_sum(r, asked[1:]) for r in rows]
                    for i, first, more in zip(chunk, firsts, rest, strict=True):
                        scores[i] = (first + more) / len(asked)
                finally:
                    for b in forks:
                        await b.prune()

            for chunk in self._chunks(docs, len(asked) * ctx.vocab_size * 4):
                await _in_parts_that_fit(chunk, one)
        return scores

    async def _yes_no(self, query: str, docs: list[str]) -> npt.NDArray[np.float32]:
        ctx = self._ctx
        text = self._prompt.replace("{document}", _SLOT).replace("{query}", query)
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

            async def one(chunk: list[int]) -> None:
                forks = [await trunk.fork(clone_logits=False) for _ in chunk]
                try:
                    inputs = [await ctx.tokenize(docs[i] + tail, add_special=False) for i in chunk]
                    await store.prefill(list(zip(forks, inputs, strict=True)))
                    for i, b in zip(chunk, forks, strict=True):
                        scores[i] = self._p_yes(b.logits)
                finally:
                    for b in forks:
                        await b.prune()

            for chunk in self._chunks(docs, 0):
                await _in_parts_that_fit(chunk, one)
        return scores

    def _p_yes(self, logits: npt.NDArray[np.float32]) -> float:
        yes = np.logaddexp.reduce(logits[self._yes].astype(np.float64))
        no = np.logaddexp.reduce(logits[self._no].astype(np.float64))
        return float(1.0 / (1.0 + np.exp(no - yes)))


async def _in_parts_that_fit(
    chunk: list[int], score: Callable[[list[int]], Awaitable[None]]
) -> None:
    """``score(chunk)``; when its documents do not fit the KV cache together,
    its halves one after the other (a batch that overflows changes nothing,
    and ``score`` prunes its forks either way). A document that does not
    fit alone raises :class:`KVCacheFullError`."""
    try:
        await score(chunk)
    except KVCacheFullError:
        if len(chunk) == 1:
            raise
        half = len(chunk) // 2
        await _in_parts_that_fit(chunk[:half], score)
        await _in_parts_that_fit(chunk[half:], score)


def _logprob_sum(rows: npt.NDArray[np.float32], tokens: Sequence[int]) -> float:
    """Sum over positions of ``log softmax(rows[k])[tokens[k]]``."""
    if not tokens:
        return 0.0
    r = rows.astype(np.float64)
    top = r.max(axis=1, keepdims=True)
    norm = np.log(np.exp(r - top).sum(axis=1)) + top[:, 0]
    picked = r[np.arange(len(tokens)), tokens]
    return float((picked - norm).sum())
