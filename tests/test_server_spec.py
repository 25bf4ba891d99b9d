"""``lloyal serve --spec prompt-lookup``: greedy requests draft from their
own prompt and reply and verify the drafts in the step's decode. With
``--deterministic`` a reply is the same tokens with and without it; the
drafts show in ``/metrics``; a request opts out with
``speculative.n_max: 0``; a choice that ends inside a round (a stop
string, ``max_tokens``) leaves its branch holding exactly its prompt and
reply, which the prefix cache then reuses."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lloyal.server import ServerConfig

from tests._asgi import in_process

pytestmark = [pytest.mark.anyio, pytest.mark.deterministic_first]

ECHO = "Copy the list.\nList: apple, pear, plum, fig, kiwi, lime, date, yuzu.\nCopy: apple, pear,"
COUNT = "1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2,"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def _server(model: Path, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    config = ServerConfig(model_path=model, n_ctx=1024, n_seq_max=4, deterministic=True, **kw)
    async with in_process(config) as (c, _):
        yield c


async def _complete(c: httpx.AsyncClient, prompt: str, **body: Any) -> dict[str, Any]:
    full = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **body}
    r = await c.post("/v1/completions", json=full)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def _metrics(c: httpx.AsyncClient) -> dict[str, float]:
    text = (await c.get("/metrics")).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines())}


async def test_speculation_keeps_the_greedy_reply(model: Path) -> None:
    bodies: list[dict[str, Any]] = [
        {},
        {"max_tokens": 5},  # ends inside a round
        {"stop": [" 5,"]},  # a stop string inside the drafts
        {"logit_bias": {"11": -100}},  # the bias applies to the drafts' checks too
    ]
    plain: list[str] = []
    async with _server(model) as c:
        for prompt in (ECHO, COUNT):
            for body in bodies:
                plain.append((await _complete(c, prompt, **body))["choices"][0]["text"])
    async with _server(model, spec="prompt-lookup", spec_k=6) as c:
        fast = []
        for prompt in (ECHO, COUNT):
            for body in bodies:
                fast.append((await _complete(c, prompt, **body))["choices"][0]["text"])
        m = await _metrics(c)
    assert fast == plain
    assert m["lloyal_spec_drafted_total"] > 0
    assert 0 < m["lloyal_spec_accepted_total"] <= m["lloyal_spec_drafted_total"]


async def test_opting_out_and_what_does_not_speculate(smollm2: Path) -> None:
    async with _server(smollm2, spec="prompt-lookup") as c:
        await _complete(c, COUNT, **{"speculative.n_max": 0})
        await _complete(c, COUNT, temperature=0.7, seed=1)  # sampled: no drafts
        await _complete(c, COUNT, logprobs=2)
        assert (await _metrics(c))["lloyal_spec_drafted_total"] == 0
        await _complete(c, COUNT)
        assert (await _metrics(c))["lloyal_spec_drafted_total"] > 0
        r = await c.post("/v1/completions", json={"prompt": "x", "speculative": 3})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "speculative"


async def test_a_speculated_reply_is_cached_whole(smollm2: Path) -> None:
    async with _server(smollm2, spec="prompt-lookup") as c:
        first = await _complete(c, COUNT, max_tokens=9)
        tokens = first["usage"]["prompt_tokens"]
        again = await _complete(c, COUNT, max_tokens=9)
        # The first request's branch (prompt and reply, drafts truncated)
        # became the cache's entry: the same prompt forks all of it but
        # its last token.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == tokens - 1
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        extended = COUNT + first["choices"][0]["text"]
        more = await _complete(c, extended, max_tokens=3)
        cached = more["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= tokens + first["usage"]["completion_tokens"] - 2


async def test_concurrent_requests_speculate_beside_plain_ones(smollm2: Path) -> None:
    async with _server(smollm2, spec="prompt-lookup") as c:
        alone = [(await _complete(c, p))["choices"][0]["text"] for p in (ECHO, COUNT)]
        together = await asyncio.gather(
            _complete(c, ECHO),
            _complete(c, COUNT),
            _complete(c, COUNT, temperature=0.9, seed=3),
        )
        assert [r["choices"][0]["text"] for r in together[:2]] == alone


async def test_a_draft_model_drafts_in_the_step_loop(smollm2: Path, gemma3: Path) -> None:
    # SmolLM2 drafting for itself: every draft is the model's own choice
    # (deterministic), so all but those past a stop are kept.
    plain: list[str] = []
    async with _server(smollm2) as c:
        for prompt in (ECHO, COUNT):
            plain.append((await _complete(c, prompt))["choices"][0]["text"])
    async with _server(smollm2, draft_model=smollm2, spec_k=4) as c:
        drafted = await asyncio.gather(*(_complete(c, p) for p in (ECHO, COUNT)))
        m = await _metrics(c)
    assert [r["choices"][0]["text"] for r in drafted] == plain
    assert m["lloyal_spec_drafted_total"] > 0
    assert m["lloyal_spec_accepted_total"] >= 0.9 * m["lloyal_spec_drafted_total"]
    with pytest.raises(ValueError, match="vocabulary"):
        async with _server(smollm2, draft_model=gemma3):
            pass
