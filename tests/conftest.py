from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lloyal
import numpy as np
import numpy.typing as npt
import pytest
from lloyal.models import model_path

MODELS = ["smollm2", "gemma3"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def model(model_name: str) -> Path:
    return model_path(model_name)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return model_path("smollm2")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return model_path("gemma3")


def open_sync(path: Path, **kwargs: object) -> lloyal.Context:
    """A context usable from any later event loop (it is loop-agnostic)."""
    return asyncio.run(lloyal.create_context(path, **kwargs))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=MODELS)
def shared_ctx(request: pytest.FixtureRequest) -> Iterator[lloyal.Context]:
    """One context per model for read-only tests (tokenizer, templates)."""
    ctx = open_sync(model_path(request.param), n_ctx=256)
    yield ctx
    ctx.close()


ROUTE_NOISE = 2.0
"""How far two decoding routes may move the same logits apart, in logits.

llama.cpp's CPU kernels give the same bits when the same tokens are decoded
the same way (same batch layout, same KV cells, same thread count), but not
when the route differs: a token decoded alone or inside a batch, a prompt in
one call or split, other KV cells. How much differs with the host's CPU.
docs/determinism.md measured up to 0.9 for one logit on the development VM;
on an AVX-512 host Gemma 3 moved one logit by up to 1.24 (far down the
distribution), its two best logits by at most 0.4 and the difference
between them by at most 0.18 (SmolLM2 kept the same bits on every route
tried). So the tests take it that, between any two routes or hosts:

- a greedy choice whose best two logits are ROUTE_NOISE apart is made the
  same way (undoing it takes the best down and the runner-up up by 1.0 each,
  over twice what the best two moved);
- two routes' logits for the same tokens are within ROUTE_NOISE of each
  other (another row or a wrong cache is 17 or more off);
- a surprisal or log-probability moves by at most ROUTE_NOISE (a log-softmax
  value: its token's logit minus a log-sum-exp led by the best logits).

A test that compares greedy tokens from two routes compares them up to the
first step below ROUTE_NOISE (``Greedy.check``), and asserts what needs every
step (acceptance rates, round counts) only when there is none.
"""


def route_distance(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    """How far two routes' logits for the same position are apart where it
    matters: the largest difference over the tokens either puts within 20
    of its best logit (everything with a chance above e^-20 of the best).
    The far tail of a 262k vocabulary moves more than ROUTE_NOISE on a long
    route split into many decodes (Gemma 3, 1,000 tokens in 16 chunks:
    2.2 seen) while nothing is sampled from there; a wrong row or cache
    moves the head by far more."""
    head = (a >= a.max() - 20.0) | (b >= b.max() - 20.0)
    return float(np.abs(a[head] - b[head]).max())


COUNTING = {
    "smollm2": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "gemma3": "1 2 3 4 5 6 7 8 9 10 11 12",
}
"""A prompt per model whose greedy continuation has wide margins: on an
AVX-512 host the first 16 steps' were at least 3.79 (SmolLM2) and 4.0
(Gemma 3), far above ROUTE_NOISE on any route."""


def top1_margin(logits: npt.ArrayLike) -> float:
    """The best logit minus the second best."""
    second, first = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(first - second)


@dataclass(frozen=True)
class Greedy:
    """A greedy continuation, with each step's top-1 margin and the chosen
    token's surprisal (nats). ``margins`` has one more entry than ``tokens``
    when the run ended on a stop token (that choice needs a margin too)."""

    tokens: list[int]
    margins: list[float]
    surprisals: list[float]

    @property
    def sure(self) -> int:
        """How many leading steps every route takes the same way: each of
        them and all before it had a margin of at least ROUTE_NOISE."""
        return next((i for i, m in enumerate(self.margins) if m < ROUTE_NOISE), len(self.margins))

    @property
    def all_sure(self) -> bool:
        """No near-tie anywhere: another route gives exactly these tokens."""
        return self.sure == len(self.margins)

    def check(self, tokens: Sequence[int], at_least: int) -> int:
        """Assert that ``tokens`` (from another decoding route) agree with
        these up to the first near-tie, and everywhere if there is none;
        that at least ``at_least`` steps were compared; return how many were."""
        n = min(self.sure, len(self.tokens))
        assert n >= at_least, f"only {n} greedy steps with margin >= {ROUTE_NOISE}: {self.margins}"
        assert list(tokens[:n]) == self.tokens[:n]
        if self.all_sure:
            assert list(tokens) == self.tokens
        return n


async def greedy_reference(
    ctx: lloyal.Context, prompt: str, max_tokens: int, stop: Iterable[int] = ()
) -> Greedy:
    """The greedy continuation of ``prompt`` by the flat loop on sequence 0
    (the prompt in one call, then one token per call), stopping where
    ``lloyal.strategies.generate`` stops. Sequence 0 is emptied afterwards."""
    stops = set(stop)
    tokens = await ctx.tokenize(prompt)
    await ctx.decode(tokens, 0)
    out: list[int] = []
    margins: list[float] = []
    surprisals: list[float] = []
    try:
        while len(out) < max_tokens:
            logits = ctx.get_logits()
            token = int(np.argmax(logits))
            margins.append(top1_margin(logits))
            if ctx.is_stop_token(token) or token in stops:
                break
            out.append(token)
            surprisals.append(ctx.model_surprisal(token))
            if len(out) < max_tokens:
                await ctx.decode([token], len(tokens) + len(out) - 1)
    finally:
        await ctx.kv_cache_remove(0, 0)
    return Greedy(out, margins, surprisals)


async def branch_greedy(branch: lloyal.Branch, n: int) -> Greedy:
    """``n`` tokens produced and committed on a greedy branch, with margins."""
    out: list[int] = []
    margins: list[float] = []
    surprisals: list[float] = []
    for _ in range(n):
        margins.append(top1_margin(branch.logits))
        p = await branch.produce()
        surprisals.append(branch.model_surprisal(p.token))
        await branch.commit(p.token)
        out.append(p.token)
    return Greedy(out, margins, surprisals)
