"""Fill in the middle: :func:`lloyal.infill.fim_prompt` lays out the code
around a cursor with the model's FIM tokens, and the server's ``/infill``
(llama-server's) and ``/v1/completions`` ``suffix`` (OpenAI's) generate the
middle. Neither test model has FIM tokens; ``fixtures.fim_model()`` is
SmolLM2 with three specials renamed and declared as them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import lloyal
import openai
import pytest
from lloyal import fixtures
from lloyal.infill import NoFimError, fim_prompt
from lloyal.server import ServerConfig

from tests._asgi import in_process

pytestmark = pytest.mark.anyio

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\nprint(add(1, 2))\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def fim_model() -> Path:
    return fixtures.fim_model()


async def test_the_fixture_declares_its_fim_tokens(fim_model: Path) -> None:
    async with await lloyal.create_context(fim_model, n_ctx=512) as ctx:
        fim = ctx.fim_tokens
        assert fim.complete
        assert (fim.prefix, fim.suffix, fim.middle) == (7, 8, 9)
        assert ctx.token_to_text(7, render_special=True) == "<fim_prefix>"
        # SmolLM2's own repository and file separators, found by their text.
        assert (fim.repo, fim.file_sep) == (3, 5)


async def test_the_prompt_is_prefix_suffix_middle(fim_model: Path) -> None:
    async with await lloyal.create_context(fim_model, n_ctx=512) as ctx:
        fim = ctx.fim_tokens
        pre = await ctx.tokenize(PREFIX, add_special=False)
        suf = await ctx.tokenize(SUFFIX, add_special=False)
        mid = await ctx.tokenize("a +", add_special=False)
        lead = await ctx.tokenize("", add_special=True)
        ids = await fim_prompt(ctx, PREFIX, SUFFIX, middle="a +")
        assert ids == [*lead, fim.prefix, *pre, fim.suffix, *suf, fim.middle, *mid]
        # Extra files first, after the repository's name.
        ids = await fim_prompt(ctx, PREFIX, SUFFIX, files=[("util.py", "X = 1\n")], repo="demo")
        head = ids[len(lead) : ids.index(fim.prefix)]
        assert head[0] == fim.repo
        assert fim.file_sep in head
        assert "util.py\nX = 1" in await ctx.detokenize(head)


async def test_a_budget_keeps_the_code_next_to_the_cursor(fim_model: Path) -> None:
    async with await lloyal.create_context(fim_model, n_ctx=512) as ctx:
        fim = ctx.fim_tokens
        prefix = "".join(f"x{i} = {i}\n" for i in range(200))
        suffix = "".join(f"y{i} = {i}\n" for i in range(200))
        files = [("other.py", "z = 0\n" * 50)]
        whole = await fim_prompt(ctx, prefix, suffix, files=files)
        cut = await fim_prompt(ctx, prefix, suffix, files=files, budget=100)
        assert len(whole) > 100 >= len(cut)
        assert fim.file_sep not in cut, "the extra files go first"
        pre = cut[cut.index(fim.prefix) + 1 : cut.index(fim.suffix)]
        suf = cut[cut.index(fim.suffix) + 1 : cut.index(fim.middle)]
        assert (await ctx.detokenize(pre)).endswith("x199 = 199\n")
        assert (await ctx.detokenize(suf)).startswith("y0 = 0\n")
        assert len(pre) >= len(suf)
        with pytest.raises(ValueError, match="budget"):
            await fim_prompt(ctx, prefix, suffix, budget=2)


async def test_models_without_fim_tokens_are_refused(model: Path) -> None:
    # SmolLM2 and Gemma 3: neither was trained to fill in the middle.
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        assert not ctx.fim_tokens.complete
        with pytest.raises(NoFimError, match="fill-in-the-middle"):
            await fim_prompt(ctx, PREFIX, SUFFIX)


@contextlib.asynccontextmanager
async def _server(model: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process(
        ServerConfig(model_path=model, n_ctx=1024, n_seq_max=2, deterministic=True)
    ) as (c, _):
        yield c


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.deterministic_first
async def test_infill_whole_and_streamed(fim_model: Path) -> None:
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "util.py", "text": "X = 1\n"}],
        "n_predict": 6,
        "temperature": 0,
    }
    async with _server(fim_model) as c:
        whole = (await c.post("/infill", json=body)).json()
        assert whole["stop"] is True
        assert whole["tokens_predicted"] <= 6
        assert whole["stop_type"] in ("eos", "limit")
        async with await lloyal.create_context(fim_model, n_ctx=1024) as ctx:
            expected = await fim_prompt(
                ctx, PREFIX, SUFFIX, files=[("util.py", "X = 1\n")], budget=1024 - 6
            )
        assert whole["tokens_evaluated"] == len(expected)
        streamed = _events((await c.post("/infill", json={**body, "stream": True})).text)
        assert [e["stop"] for e in streamed] == [False] * (len(streamed) - 1) + [True]
        assert "".join(e["content"] for e in streamed) == whole["content"]
        assert streamed[-1]["tokens_predicted"] == whole["tokens_predicted"]
        # The same prompt again: the prefix cache gave all but its last token.
        assert streamed[-1]["tokens_cached"] == len(expected) - 1
        for bad, param in [
            ({"input_prefix": 3}, "input_prefix"),
            ({"input_extra": [{"text": 1}]}, "input_extra"),
            ({"n": 2}, "n"),
        ]:
            r = await c.post("/infill", json={**body, **bad})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == param


async def test_openai_completions_with_a_suffix(fim_model: Path, smollm2: Path) -> None:
    async with _server(fim_model) as c:
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="x", http_client=c)
        r = await client.completions.create(
            model="m", prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0
        )
        async with await lloyal.create_context(fim_model, n_ctx=1024) as ctx:
            expected = await fim_prompt(ctx, PREFIX, SUFFIX)
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(expected)
        assert r.choices[0].finish_reason in ("stop", "length")
    async with _server(smollm2) as c:
        r2 = await c.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX})
        assert r2.status_code == 400
        assert "fill-in-the-middle" in r2.json()["error"]["message"]
