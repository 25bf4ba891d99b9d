"""What third-party OpenAI clients expect of `lloyal serve` beyond the
everyday requests (issue 30's protocol findings), against a subprocess on
SmolLM2, with raw HTTP and the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from lloyal.models import model_path

from tests._hang import HANG_GUARD_S, deadline
from tests.conftest import open_sync
from tests.server_fuzz import metrics, start_server, stop_server
from tests.test_chat_tools import NESTED
from tests.test_server import WEATHER


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--n-seq-max", "4", "--n-ctx", "1024", "--deterministic")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def lt_token() -> int:
    """SmolLM2's token for ``<`` (a possible tool-call opener's start)."""
    ctx = open_sync(model_path("smollm2"), n_ctx=64)
    try:
        (token,) = ctx.tokenize_sync("<", add_special=False)
        return token
    finally:
        ctx.close()


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: ") :]))
    return out


def test_a_streamed_reply_with_tools_keeps_its_last_text(server: str, lt_token: int) -> None:
    # "<" could open a tool call, so the stream holds it back; the finish
    # chunk must send what was held (before, "<<<" streamed as "<<").
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "tools": [WEATHER],
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": {str(lt_token): 100},
    }
    whole = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=HANG_GUARD_S).json()
    content = whole["choices"][0]["message"]["content"]
    assert content == "<<<"
    r = httpx.post(
        f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=HANG_GUARD_S
    )
    chunks = sse(r)
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == content
    # OpenAI's keys in every chunk, null until set.
    for c in chunks:
        for choice in c["choices"]:
            assert {"finish_reason", "logprobs"} <= choice.keys(), choice
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.fixture
def client(server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_tools_and_response_format_together(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
        max_tokens=40,
        temperature=0,
    )
    message = r.choices[0].message
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "get_weather"
    else:
        assert "answer" in json.loads(message.content or "")


def test_tool_parameters_with_defs(server: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Ship it to Paris."}],
        "tools": [NESTED],
        "tool_choice": "required",
        "max_tokens": 40,
        "temperature": 0,
    }
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"][:1]
    assert "city" in json.loads(call["function"]["arguments"])["to"]


def test_streamed_completions_echo_and_logprobs(server: str) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    whole = httpx.post(
        f"{server}/v1/completions", json={**body, "echo": True, "logprobs": 2}, timeout=HANG_GUARD_S
    ).json()["choices"][0]
    r = httpx.post(
        f"{server}/v1/completions",
        json={**body, "echo": True, "logprobs": 2, "stream": True},
        timeout=HANG_GUARD_S,
    )
    chunks = [c["choices"][0] for c in sse(r) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[0]["text"] == body["prompt"], "the echo comes first"
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_model_by_id_unprefixed_paths_and_error_codes(server: str, client: openai.OpenAI) -> None:
    (listed,) = client.models.list().data
    assert client.models.retrieve(listed.id).id == listed.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # llama-server's unprefixed paths.
    assert httpx.get(f"{server}/models", timeout=HANG_GUARD_S).json()["data"][0]["id"] == listed.id
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{server}/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200
    # JSON bodies for Starlette's own 404 and 405.
    for r in (
        httpx.get(f"{server}/nope", timeout=HANG_GUARD_S),
        httpx.get(f"{server}/v1/chat/completions", timeout=HANG_GUARD_S),
    ):
        assert r.status_code in (404, 405)
        assert "message" in r.json()["error"]
    # A prompt over the context: OpenAI's code.
    long = {"prompt": [1000 + i % 5000 for i in range(1100)], "max_tokens": 1}
    r = httpx.post(f"{server}/v1/completions", json=long, timeout=HANG_GUARD_S)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_llama_server_routes(server: str) -> None:
    r = httpx.post(f"{server}/tokenize", json={"content": "Hello world"}, timeout=HANG_GUARD_S)
    tokens = r.json()["tokens"]
    assert tokens
    assert all(isinstance(t, int) for t in tokens)
    pieces = httpx.post(
        f"{server}/tokenize",
        json={"content": "Hello world", "with_pieces": True},
        timeout=HANG_GUARD_S,
    ).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert "".join(p["piece"] for p in pieces) == "Hello world"
    assert httpx.post(
        f"{server}/detokenize", json={"tokens": tokens}, timeout=HANG_GUARD_S
    ).json() == {"content": "Hello world"}
    for bad in ({"tokens": [-1]}, {"tokens": "x"}, {"tokens": [10**9]}):
        r = httpx.post(f"{server}/detokenize", json=bad, timeout=HANG_GUARD_S)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{server}/tokenize", json={"content": 3}, timeout=HANG_GUARD_S)
    assert r.status_code == 400
    prompt = httpx.post(
        f"{server}/apply-template",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        timeout=HANG_GUARD_S,
    ).json()["prompt"]
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    props = httpx.get(f"{server}/props", timeout=HANG_GUARD_S).json()
    assert props["default_generation_settings"]["n_ctx"] == 1024
    assert props["total_slots"] == 4
    assert props["modalities"] == {"vision": False, "audio": False}
    assert "<|im_start|>" in props["chat_template"]


def test_embeddings_take_token_ids_and_refuse_other_dimensions(
    server: str, client: openai.OpenAI
) -> None:
    text = "a cat sat on the mat"
    r = httpx.post(f"{server}/tokenize", json={"content": text}, timeout=HANG_GUARD_S)
    tokens = r.json()["tokens"]
    by_text = client.embeddings.create(model="m", input=text).data[0].embedding
    by_ids = client.embeddings.create(model="m", input=tokens).data[0].embedding
    both = client.embeddings.create(model="m", input=[tokens, tokens]).data
    assert len(both) == 2
    assert max(abs(a - b) for a, b in zip(by_text, by_ids, strict=True)) < 1e-6
    body = {"input": [[-1]]}
    assert httpx.post(f"{server}/v1/embeddings", json=body, timeout=HANG_GUARD_S).status_code == 400
    r = httpx.post(
        f"{server}/v1/embeddings", json={"input": "x", "dimensions": 3}, timeout=HANG_GUARD_S
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions"
    full = {"input": "x", "dimensions": len(by_text)}
    assert httpx.post(f"{server}/v1/embeddings", json=full, timeout=HANG_GUARD_S).status_code == 200
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "def f(", "suffix": "return 1"},
        timeout=HANG_GUARD_S,
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "suffix"


def test_a_client_that_leaves_while_queued_is_dropped_at_once() -> None:
    """One KV sequence: a long stream holds it, a second streaming request
    waits in the queue and its client leaves. The waiting request must go
    at once (before, it was admitted and prefilled when the first ended,
    and dropped only at its first token)."""
    proc, url = start_server("--n-seq-max", "1", "--n-ctx", "4096", "--no-prefix-cache")
    try:

        async def run() -> None:
            holder = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
            queued = {"prompt": [1000 + i for i in range(300)], "max_tokens": 4}
            async with (
                httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c,
                c.stream("POST", "/v1/completions", json={**holder, "stream": True}) as a,
            ):
                assert a.status_code == 200
                lines = a.aiter_lines()
                await anext(lines)  # the holder is running
                before = metrics(url)
                b = asyncio.create_task(c.post("/v1/completions", json={**queued, "stream": True}))
                # A hang guard, not a speed check: the request is seen
                # waiting, then its client leaves.
                give_up = deadline()
                while metrics(url)["lloyal_requests_waiting"] < 1:
                    assert time.monotonic() < give_up, "the request never queued"
                    await asyncio.sleep(0.05)
                b.cancel()
                await asyncio.gather(b, return_exceptions=True)
                while metrics(url)["lloyal_requests_waiting"] > 0:
                    assert time.monotonic() < give_up, "the request that left still waits"
                    await asyncio.sleep(0.05)
                after = metrics(url)
                assert after["lloyal_requests_active"] == 1, "the holder still runs"
                assert after["lloyal_prompt_tokens_total"] == before["lloyal_prompt_tokens_total"]
                assert after["lloyal_client_disconnects_total"] >= 1

        asyncio.run(run())
    finally:
        stop_server(proc)


def test_rerank(server: str) -> None:
    body = {
        "query": "a cat sat on the mat",
        "documents": ["tax law of the federal republic", "a kitten sat on a rug", "stocks"],
        "top_n": 2,
        "return_documents": True,
    }
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(f"{server}{path}", json=body, timeout=HANG_GUARD_S)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert len(results) == 2
        assert results[0]["index"] == 1, "the kitten is nearest"
        assert results[0]["relevance_score"] >= results[1]["relevance_score"]
        assert results[0]["document"] == {"text": body["documents"][1]}
    for bad in ({**body, "documents": []}, {**body, "query": ""}, {**body, "top_n": 0}):
        assert httpx.post(f"{server}/v1/rerank", json=bad, timeout=HANG_GUARD_S).status_code == 400


def test_several_prompts_in_one_completions_request(server: str) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    body = {"max_tokens": 3, "temperature": 0, "n": 2}
    r = httpx.post(
        f"{server}/v1/completions", json={**body, "prompt": prompts}, timeout=HANG_GUARD_S
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    alone = [
        httpx.post(
            f"{server}/v1/completions", json={**body, "prompt": p}, timeout=HANG_GUARD_S
        ).json()
        for p in prompts
    ]
    assert [c["text"] for c in out["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    assert out["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    streamed = {**body, "prompt": prompts, "stream": True}
    r = httpx.post(f"{server}/v1/completions", json=streamed, timeout=HANG_GUARD_S)
    assert r.status_code == 400


def test_cached_tokens_count_the_prefix_the_cache_gave(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Tell me about the moon in one line, please."}]
    usages = [
        client.chat.completions.create(model="m", messages=ask, max_tokens=2, temperature=0).usage
        for _ in range(2)
    ]
    first, second = (u for u in usages if u is not None)
    assert first.prompt_tokens == second.prompt_tokens
    assert first.prompt_tokens_details is not None
    assert second.prompt_tokens_details is not None
    # The second is the first's prompt again: all of it came from the
    # cache but the last token, whose logits a fork cannot give.
    assert second.prompt_tokens_details.cached_tokens == second.prompt_tokens - 1
    assert first.prompt_tokens_details.cached_tokens < second.prompt_tokens_details.cached_tokens
