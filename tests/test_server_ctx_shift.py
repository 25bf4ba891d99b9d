"""``lloyal serve --context-shift``: a prompt over the context is cut to
its first ``n_keep`` tokens and its end, and a reply that reaches the
context's end is reseeded (BlinkKV) and goes on to ``max_tokens``; without
it the first is a 400 and the second ends with ``length`` at the
context's end. Both test models."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lloyal.server import ServerConfig

from tests._asgi import in_process

pytestmark = pytest.mark.anyio

N_CTX = 256


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def _server(model: Path, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process(ServerConfig(model_path=model, n_ctx=N_CTX, n_seq_max=3, **kw)) as (c, _):
        yield c


async def _shifts(c: httpx.AsyncClient) -> float:
    for line in (await c.get("/metrics")).text.splitlines():
        if line.startswith("lloyal_context_shifts_total "):
            return float(line.split()[1])
    raise AssertionError("no lloyal_context_shifts_total")


LONG_REPLY = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "seed": 1}
LONG_PROMPT = {"prompt": "one two three four " * 120, "max_tokens": 4}


async def test_a_reply_goes_past_the_context_end(model: Path) -> None:
    async with _server(model, ctx_shift=True) as c:
        r = (await c.post("/v1/completions", json=LONG_REPLY)).json()
        assert r["usage"]["completion_tokens"] == 400
        assert r["choices"][0]["finish_reason"] == "length"
        shifts = await _shifts(c)
        # Each shift leaves half the context; 400 tokens from a short
        # prompt in 256 cells need at least two.
        assert shifts >= 2
        # Streamed, with speculation off: the same count.
        r2 = await c.post("/v1/completions", json={**LONG_REPLY, "stream": True, "seed": 2})
        assert r2.status_code == 200
        assert r2.text.rstrip().endswith("data: [DONE]")
        assert await _shifts(c) >= shifts + 2
        r3 = (await c.post("/v1/completions", json=LONG_PROMPT)).json()
        assert r3["usage"]["prompt_tokens"] > N_CTX
        assert r3["usage"]["completion_tokens"] == 4


async def test_without_it_the_context_end_is_the_end(smollm2: Path) -> None:
    async with _server(smollm2) as c:
        r = (await c.post("/v1/completions", json=LONG_REPLY)).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] < N_CTX
        r2 = await c.post("/v1/completions", json=LONG_PROMPT)
        assert r2.status_code == 400
        assert r2.json()["error"]["code"] == "context_length_exceeded"
        assert await _shifts(c) == 0


async def test_a_shifting_reply_speculates_and_serves_beside_others(smollm2: Path) -> None:
    async with _server(smollm2, ctx_shift=True, spec="prompt-lookup") as c:
        body = {"prompt": "1, 2, 3, 1, 2, 3, 1, 2, 3,", "max_tokens": 300, "temperature": 0}
        r = (await c.post("/v1/completions", json=body)).json()
        # The count goes on: the reply passes the context's end, drafting
        # from what the shift kept.
        assert r["usage"]["completion_tokens"] == 300
        text = (await c.get("/metrics")).text
        assert "lloyal_spec_accepted_total 0\n" not in text
        assert await _shifts(c) >= 1
        short = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert short.status_code == 200
