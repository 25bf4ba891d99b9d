"""`lloyal serve --lora-scaled ...` (a subprocess, SmolLM2, the random
LoRA of ``lloyal.fixtures`` loaded at scale 0): per-request ``lora``,
``/lora-adapters``, and requests under different sets running together.

Requests are greedy, on a deterministic server (``--deterministic``): a
request's logits are the same bits whatever it is batched with, so its
tokens alone and beside others are the same. (Without it, the random
LoRA's near-ties flip with the rounding of each route: llama.cpp multiplies
one row and several rows of its f32 matrices by different kernels.)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from lloyal import fixtures

from tests._hang import HANG_GUARD_S
from tests.server_fuzz import start_server, stop_server

ASK = [{"role": "user", "content": "Write one sentence about the sea."}]
TUNED = [{"id": 0, "scale": 1.0}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    lora = str(fixtures.lora("random"))
    proc, url = start_server(
        "--n-seq-max", "6", "--n-ctx", "2048", "--lora-scaled", lora, "0", "--deterministic"
    )
    yield url
    stop_server(proc)


def chat(url: str, lora: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    body: dict[str, Any] = {"messages": ASK, "max_tokens": 12, "temperature": 0.0, **extra}
    if lora is not None:
        body["lora"] = lora
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_requests_with_different_adapters_together_each_get_what_they_get_alone(
    server: str,
) -> None:
    first = chat(server), chat(server, TUNED)
    assert first[0] != first[1], "the adapter changes the reply"
    assert chat(server, [{"id": 0, "scale": 0.0}]) == first[0], "scale 0 is the base"
    # From here on both prompts come from the prefix cache, each under its
    # own set: the same route alone and together.
    base, tuned = chat(server), chat(server, TUNED)
    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda lora: chat(server, lora), [None, TUNED]))
        assert got == [base, tuned]


def test_lora_adapters_lists_and_sets_the_default_scales(server: str) -> None:
    listed = httpx.get(f"{server}/lora-adapters", timeout=HANG_GUARD_S).json()
    assert listed == [{"id": 0, "path": str(fixtures.lora("random")), "scale": 0.0}]
    base, tuned = chat(server), chat(server, TUNED)
    try:
        r = httpx.post(
            f"{server}/lora-adapters", json=[{"id": 0, "scale": 1.0}], timeout=HANG_GUARD_S
        )
        assert r.status_code == 200
        assert r.json()[0]["scale"] == 1.0
        assert chat(server) == tuned, "the default set is now the adapter"
        assert chat(server, []) == base, "an empty lora list is the base"
    finally:
        httpx.post(f"{server}/lora-adapters", json=[], timeout=HANG_GUARD_S)
    assert httpx.get(f"{server}/lora-adapters", timeout=HANG_GUARD_S).json()[0]["scale"] == 0.0


@pytest.mark.parametrize(
    ("lora", "needle"),
    [
        ([{"id": 1, "scale": 1.0}], "not loaded"),
        ([{"id": 0, "scale": "big"}], "scale"),
        ([{"id": 0}, {"id": 0}], "twice"),
        ({"id": 0}, "list"),
        ([{"id": -1}], "id"),
        ([{"id": 0, "weight": 2}], "entry"),
    ],
)
def test_bad_lora_fields_are_400_naming_the_field(server: str, lora: object, needle: str) -> None:
    body = {"messages": ASK, "max_tokens": 2, "lora": lora}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora", error
    assert needle in error["message"], error


@pytest.mark.parametrize("body", [b"null", b'{"id": 0}', b'"x"', b"3"])
def test_a_lora_adapters_body_that_is_not_a_list_is_a_400(server: str, body: bytes) -> None:
    """``null`` was a 500 (an assertion: it reads as "the default set" in a
    request's ``lora`` field, which means nothing here)."""
    r = httpx.post(
        f"{server}/lora-adapters",
        content=body,
        headers={"content-type": "application/json"},
        timeout=HANG_GUARD_S,
    )
    assert r.status_code == 400, r.text
    assert "body" in r.json()["error"]["message"]
