"""Several models on one server: each opens on first use, ``models_max``
closes the least recently used idle one, a model in use is never closed
under its request, and a request for a model that is not open waits for
it rather than failing. SmolLM2 and Gemma 3 are the two models."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from lloyal._serve_cli import _models
from lloyal.server import ServerConfig
from lloyal.server._models import Models

from tests._asgi import in_process
from tests._hang import deadline
from tests.server_fuzz import metrics, start_server, stop_server

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _config(smollm2: Path, gemma3: Path, **kw: Any) -> ServerConfig:
    return ServerConfig(
        models=(("smol", smollm2), ("gemma", gemma3)), n_ctx=1024, n_seq_max=2, **kw
    )


@contextlib.asynccontextmanager
async def _app(config: ServerConfig) -> AsyncIterator[tuple[httpx.AsyncClient, Models]]:
    async with in_process(config) as (c, app):
        yield c, app.state.lloyal


async def _complete(c: httpx.AsyncClient, model: str | None) -> httpx.Response:
    # A completion, not a chat: Gemma's GGUF has no chat template.
    body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 3, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    return await c.post("/v1/completions", json=body)


async def _poll(condition: Any, why: str) -> None:
    """Wait for what must happen (a hang guard, not a timing)."""
    give_up = deadline()
    while time.monotonic() < give_up:
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"hang guard: {why}")


async def test_alternating_requests_open_and_close_models_and_never_fail(
    smollm2: Path, gemma3: Path
) -> None:
    async with _app(_config(smollm2, gemma3, models_max=1)) as (c, models):
        listed = (await c.get("/v1/models")).json()["data"]
        assert [(m["id"], m["status"]["value"]) for m in listed] == [
            ("smol", "unloaded"),
            ("gemma", "unloaded"),
        ]
        for name in ("smol", "gemma", "smol", "gemma"):
            r = await _complete(c, name)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            assert models.loaded() == [name]
        assert (models.loads("smol"), models.loads("gemma")) == (2, 2)
        status = {m["id"]: m["status"]["value"] for m in (await c.get("/v1/models")).json()["data"]}
        assert status == {"smol": "unloaded", "gemma": "loaded"}
        # No model named: the first one.
        r = await _complete(c, None)
        assert r.json()["model"] == "smol"
        assert models.loaded() == ["smol"]
        # Concurrent requests for both: each waits its turn, none fails.
        replies = await asyncio.gather(*(_complete(c, n) for n in ["gemma", "smol"] * 3))
        assert [r.status_code for r in replies] == [200] * 6
        assert [r.json()["model"] for r in replies] == ["gemma", "smol"] * 3
        assert all(models.users(n) == 0 for n in ("smol", "gemma"))


async def test_without_a_limit_both_stay_open(smollm2: Path, gemma3: Path) -> None:
    async with _app(_config(smollm2, gemma3)) as (c, models):
        for name in ("gemma", "smol", "gemma"):
            assert (await _complete(c, name)).status_code == 200
        assert sorted(models.loaded()) == ["gemma", "smol"]
        assert (models.loads("smol"), models.loads("gemma")) == (1, 1)
        text = (await c.get("/metrics")).text
        assert "lloyal_models_loaded 2" in text
        assert 'lloyal_requests_total{model="gemma"} 2' in text


async def test_a_model_in_use_is_not_closed_under_its_request(smollm2: Path, gemma3: Path) -> None:
    async with _app(_config(smollm2, gemma3, models_max=1)) as (c, models):
        async with models.lease("smol"):
            other = asyncio.ensure_future(_complete(c, "gemma"))
            await _poll(lambda: models.waiting == 1, "the gemma request never queued")
            assert not other.done()
            assert models.loaded() == ["smol"]
        r = await other
        assert r.status_code == 200, r.text
        assert models.loaded() == ["gemma"]


async def test_an_unknown_model_is_a_404_in_each_api(smollm2: Path, gemma3: Path) -> None:
    async with _app(_config(smollm2, gemma3)) as (c, models):
        r = await _complete(c, "nope")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert "smol, gemma" in r.json()["error"]["message"]
        r = await c.get("/v1/models/nope")
        assert r.status_code == 404
        assert (await c.get("/v1/models/gemma")).json()["id"] == "gemma"
        r = await c.post("/v1/messages", json={"model": "nope", "max_tokens": 2, "messages": ASK})
        assert r.status_code == 404
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "not_found_error"
        assert models.loaded() == []


async def test_keep_alive_closes_an_idle_model(smollm2: Path, gemma3: Path) -> None:
    async with _app(_config(smollm2, gemma3, keep_alive=0.05)) as (c, models):
        assert (await _complete(c, "gemma")).status_code == 200
        await _poll(lambda: models.loaded() == [], "keep-alive never closed gemma")
        assert (await _complete(c, "gemma")).status_code == 200
        assert models.loads("gemma") == 2


def test_what_a_server_of_several_models_refuses(smollm2: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a model"):
        ServerConfig()
    with pytest.raises(ValueError, match="same name"):
        ServerConfig(models=(("a", smollm2), ("a", smollm2)))
    with pytest.raises(ValueError, match="one model"):
        ServerConfig(models=(("a", smollm2), ("b", smollm2)), mmproj=tmp_path / "p.gguf")
    with pytest.raises(ValueError, match="models_max"):
        ServerConfig(model_path=smollm2, models_max=0)


def test_the_command_line_names_models_by_flag_file_or_folder(tmp_path: Path) -> None:
    for f in ("b.gguf", "a.gguf", "mmproj-a.gguf"):
        (tmp_path / f).write_bytes(b"")
    one, rest = _models(["x/m.gguf"], None)
    assert (one, rest) == (Path("x/m.gguf"), ())
    one, rest = _models(["small=x/m.gguf"], None)
    assert (one, rest) == (None, (("small", Path("x/m.gguf")),))
    one, rest = _models(["x/m.gguf", "y=z.gguf"], str(tmp_path))
    names = [name for name, _ in rest]
    assert one is None
    assert names == ["a", "b", "m", "y"]
    with pytest.raises(ValueError, match=r"no \.gguf"):
        _models([], str(tmp_path / "a.gguf"))


@pytest.fixture(scope="module")
def two_models(smollm2: Path, gemma3: Path) -> Iterator[str]:
    proc, url = start_server(
        "--model", f"smol={smollm2}", "--model", f"gemma={gemma3}", "--models-max", "1",
        "--n-ctx", "1024", "--n-seq-max", "2",
    )  # fmt: skip
    yield url
    stop_server(proc)


def test_a_stream_keeps_its_model_while_the_other_waits(two_models: str) -> None:
    client = openai.OpenAI(base_url=f"{two_models}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="smol", messages=ASK, max_tokens=8, temperature=0.0, stream=True
    )
    first = next(iter(stream))
    assert first.model == "smol"
    other: dict[str, Any] = {}

    def ask_gemma() -> None:
        other["r"] = client.completions.create(model="gemma", prompt="Hello", max_tokens=3)

    thread = threading.Thread(target=ask_gemma)
    thread.start()
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    thread.join()
    assert isinstance(text, str)
    assert other["r"].model == "gemma"
    # The Anthropic SDK reaches the same models by the same names.
    reply = anthropic.Anthropic(base_url=two_models, api_key="x", max_retries=0).messages.create(
        model="smol", max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
    )
    assert reply.model == "smol"
    assert metrics(two_models)["lloyal_models_loaded"] == 1


async def test_a_memory_budget_closes_the_least_recent(smollm2: Path, gemma3: Path) -> None:
    # A budget nothing fits beside: one model open at a time (one alone
    # still opens); a budget both fit: both stay open.
    async with _app(_config(smollm2, gemma3, models_memory=1)) as (c, models):
        for name in ("smol", "gemma", "smol"):
            assert (await _complete(c, name)).status_code == 200
            assert models.loaded() == [name]
    async with _app(_config(smollm2, gemma3, models_memory=16 << 30)) as (c, models):
        for name in ("smol", "gemma"):
            assert (await _complete(c, name)).status_code == 200
        assert sorted(models.loaded()) == ["gemma", "smol"]
