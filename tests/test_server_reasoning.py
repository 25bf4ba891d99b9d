"""The server's reasoning controls, in process: ``reasoning_budget`` (a
request's, or ``--reasoning-budget``) cuts the thinking at that many
tokens; ``reasoning_effort`` reaches the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import lloyal
import pytest
from lloyal import fixtures
from lloyal.server import ServerConfig, create_app

from tests._asgi import in_process
from tests._hang import HANG_GUARD_S
from tests.test_chat_families import THINKING_TEMPLATE

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def chat(config: ServerConfig, **body: Any) -> httpx.Response:
    async with in_process(config) as (c, _):
        full = {"messages": ASK, "max_tokens": 24, "temperature": 0.0, **body}
        return await c.post("/v1/chat/completions", json=full)


async def test_a_reasoning_budget_cuts_the_thinking(smollm2: Path) -> None:
    config = ServerConfig(model_path=smollm2, n_ctx=1024, n_seq_max=2, template=THINKING_TEMPLATE)
    free = (await chat(config)).json()["choices"][0]["message"]
    cut = (await chat(config, reasoning_budget=2)).json()["choices"][0]["message"]
    assert len(free["reasoning_content"]) > len(cut["reasoning_content"]) > 0
    limited = ServerConfig(**{**config.__dict__, "reasoning_budget": 2})
    by_flag = (await chat(limited)).json()["choices"][0]["message"]
    assert by_flag["reasoning_content"] == cut["reasoning_content"]


async def test_reasoning_effort_reaches_the_template(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered: list[str] = []
    original = lloyal.Context.format_chat

    def spy(self: lloyal.Context, *args: Any, **kwargs: Any) -> Any:
        prompt = original(self, *args, **kwargs)
        rendered.append(prompt.prompt)
        return prompt

    monkeypatch.setattr(lloyal.Context, "format_chat", spy)
    config = ServerConfig(
        model_path=smollm2, n_ctx=2048, n_seq_max=2, template=fixtures.TOOL_TEMPLATES["gpt-oss"]
    )
    for effort in ("high", None):
        body = {"reasoning_effort": effort} if effort else {}
        r = await chat(config, max_tokens=2, **body)
        assert r.status_code == 200, r.text
    assert "Reasoning: high" in rendered[0]
    assert "Reasoning: medium" in rendered[1]  # the template's default
    bad = await chat(config, reasoning_effort="extreme")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "reasoning_effort"


async def test_anthropic_thinking_blocks_whole_and_streamed(smollm2: Path) -> None:
    """Anthropic's ``thinking`` (its budget as the reasoning budget): the
    reasoning comes back as a thinking block before the text, whole and as
    ``thinking_delta`` events."""
    config = ServerConfig(model_path=smollm2, n_ctx=1024, n_seq_max=2, template=THINKING_TEMPLATE)
    app = create_app(config)
    body = {
        "model": "m",
        "max_tokens": 24,
        "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 3},
        "messages": ASK,
    }
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://x", timeout=HANG_GUARD_S
        ) as c:
            whole = (await c.post("/v1/messages", json=body)).json()
            streamed = await c.post("/v1/messages", json={**body, "stream": True})
    kinds = [b["type"] for b in whole["content"]]
    assert kinds[0] == "thinking", whole
    assert whole["content"][0]["thinking"]
    lines = streamed.text.splitlines()
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
    thought = "".join(
        e["delta"]["thinking"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
    )
    assert thought == whole["content"][0]["thinking"]


@pytest.mark.deterministic_first
async def test_reasoning_format_none_leaves_the_reasoning_in_the_content(smollm2: Path) -> None:
    config = ServerConfig(
        model_path=smollm2, n_ctx=1024, n_seq_max=2, template=THINKING_TEMPLATE, deterministic=True
    )
    split = (await chat(config, reasoning_budget=3)).json()["choices"][0]["message"]
    assert split["reasoning_content"]
    raw = (await chat(config, reasoning_budget=3, reasoning_format="none")).json()
    message = raw["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert split["reasoning_content"] in message["content"]
    assert message["content"].endswith(split["content"] or "")
    assert "</think>" in message["content"]
    by_flag = ServerConfig(**{**config.__dict__, "reasoning_format": "none"})
    flagged = (await chat(by_flag, reasoning_budget=3)).json()["choices"][0]["message"]
    assert flagged["content"] == message["content"]
    streamed = await chat(config, reasoning_budget=3, reasoning_format="none", stream=True)
    deltas = [
        json.loads(line[6:])["choices"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    text = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert text == message["content"]
    assert not any(c[0]["delta"].get("reasoning_content") for c in deltas if c)
    bad = await chat(config, reasoning_format="sometimes")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "reasoning_format"
