"""`lloyal serve --mmproj` (a subprocess: SmolLM2 with the random projector
of ``lloyal.fixtures``) against the official openai client: images as
OpenAI ``image_url`` parts, and the requests it must refuse."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from lloyal import fixtures

from tests._hang import HANG_GUARD_S
from tests.server_fuzz import start_server, stop_server
from tests.test_media import picture, png


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server(
        "--n-seq-max", "4", "--n-ctx", "2048", "--mmproj", str(fixtures.mmproj()), "--deterministic"
    )
    yield url
    stop_server(proc)


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def data_url(pixels: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png(pixels)).decode()


def ask(url: str) -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Describe the picture."},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def reply(client: openai.OpenAI, url: str) -> tuple[str, int]:
    r = client.chat.completions.create(model="m", messages=ask(url), max_tokens=8, temperature=0.0)
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens


def test_an_image_in_a_chat_request(client: openai.OpenAI, server: str) -> None:
    text, used = reply(client, data_url(picture(1)))
    assert text
    # The 16 positions of the image count as prompt tokens.
    plain = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Describe the picture."}],
        max_tokens=1,
    )
    assert plain.usage is not None
    assert used == plain.usage.prompt_tokens + 16
    # The same image again: the same reply (from the prefix cache now).
    assert reply(client, data_url(picture(1)))[0] == text
    metrics = httpx.get(f"{server}/metrics", timeout=HANG_GUARD_S).text
    assert "lloyal_prefix_cache_saved_tokens_total" in metrics
    # Streamed, the same text.
    stream = client.chat.completions.create(
        model="m", messages=ask(data_url(picture(1))), max_tokens=8, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


@pytest.mark.parametrize(
    ("part", "says"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "data: URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
            "could not be read",
        ),
        ({"type": "input_audio", "input_audio": {"data": 3}}, "base64"),
        ({"type": "video", "video": "x"}, "parts are"),
    ],
)
def test_bad_media_are_400s(server: str, part: dict[str, Any], says: str) -> None:
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 4}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    # The server goes on.
    assert httpx.get(f"{server}/health", timeout=HANG_GUARD_S).status_code == 200


def test_a_server_without_a_projector_refuses_images() -> None:
    proc, url = start_server("--n-seq-max", "2", "--n-ctx", "512", "--no-prefix-cache")
    try:
        body = {"messages": ask(data_url(picture(2))), "max_tokens": 4}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
        assert r.status_code == 400
        assert "--mmproj" in r.json()["error"]["message"]
    finally:
        stop_server(proc)


def test_an_image_in_an_anthropic_tool_result(server: str) -> None:
    """A ``tool_result`` holding an image (a screenshot tool's answer) goes
    to the model with its image: its 16 positions count as input (it was a
    400)."""
    import anthropic

    image = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png(picture(2))).decode(),
        },
    }
    call = {"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}
    tool = {"name": "screenshot", "input_schema": {"type": "object", "properties": {}}}

    def chat(result: list[Any]) -> list[Any]:
        return [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [call]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}],
            },
        ]

    text = [{"type": "text", "text": "Here it is."}]
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0) as client:
        kw: dict[str, Any] = {"model": "m", "tools": [tool]}
        with_image = client.messages.count_tokens(messages=chat([*text, image]), **kw)
        without = client.messages.count_tokens(messages=chat(text), **kw)
        assert with_image.input_tokens == without.input_tokens + 16
        r = client.messages.create(max_tokens=4, messages=chat([*text, image]), **kw)
        assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == (
            with_image.input_tokens
        )
