"""`lloyal serve` against the official openai client and raw HTTP.

The server runs as a subprocess (``python -m lloyal serve``) on SmolLM2,
so the CLI, the ASGI app and the engine are tested together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lloyal", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _stop(proc)
            raise RuntimeError("the server died at startup")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    _stop(proc)
    raise RuntimeError("the server did not start in 60 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = _start("--n-seq-max", "8", "--n-ctx", "4096")
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines())}


def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    (model,) = client.models.list().data
    assert model.id
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_chat_completion_with_n_choices_from_one_prompt(client: openai.OpenAI, server: str) -> None:
    before = _metrics(server)
    r = client.chat.completions.create(
        model="anything", messages=ASK, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage is not None
    assert r.usage.completion_tokens <= 18
    after = _metrics(server)
    # The prompt went through the model once for the three choices.
    assert after["lloyal_prompt_tokens_total"] - before["lloyal_prompt_tokens_total"] == (
        r.usage.prompt_tokens
    )


def test_streaming_matches_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"messages": ASK, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(model="m", **kwargs)
    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model="m", stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    done = client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=3, logprobs=2, temperature=0
    )
    lp = done.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == 3
    assert len(lp.top_logprobs[0]) == 2


def test_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "seed": 3,
    }
    r = client.chat.completions.create(model="m", **kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls  # type: ignore[misc]
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    args = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    name, streamed, finish = None, "", None
    for chunk in client.chat.completions.create(model="m", stream=True, **kwargs):
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            name = tc.function.name or name  # type: ignore[union-attr]
            streamed += tc.function.arguments or ""  # type: ignore[union-attr]
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(streamed), finish) == ("get_weather", args, "tool_calls")


def test_json_schema_response(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


def test_embeddings(client: openai.OpenAI) -> None:
    r = client.embeddings.create(model="m", input=["a cat sat", "a kitten sat", "tax law"])
    v = np.array([d.embedding for d in r.data])
    assert v.shape[0] == 3
    assert v[0] @ v[1] > v[0] @ v[2]
    floats = client.embeddings.create(model="m", input="a cat sat", encoding_format="float")
    assert np.allclose(floats.data[0].embedding, v[0], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"not json", None),
        (b"[]", None),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"content": "x"}]}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', "stop"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', None),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}',
            "response_format",
        ),
    ],
)
def test_bad_chat_requests_are_400(server: str, body: bytes, param: str | None) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", content=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param


def test_bad_completion_and_embedding_requests_are_400(server: str) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": [10**9]}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}),
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}),
    ]:
        r = httpx.post(f"{server}{path}", json=body)
        assert r.status_code == 400, (path, body, r.text)
    assert httpx.get(f"{server}/v1/nothing").status_code == 404
    # The server is still fine.
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200


def test_a_client_that_disconnects_frees_its_branch(server: str) -> None:
    before = _metrics(server)
    # ignore_eos (llama-server's extension): the answer cannot end early.
    body = {"messages": ASK, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server}/v1/chat/completions",
            json={**body, "stream": False},
            timeout=httpx.Timeout(5, read=1.0),
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["lloyal_requests_active"] == 0 and m["lloyal_client_disconnects_total"] >= (
            before["lloyal_client_disconnects_total"] + 2
        ):
            break
        time.sleep(0.1)
    assert m["lloyal_requests_active"] == 0
    assert m["lloyal_client_disconnects_total"] == before["lloyal_client_disconnects_total"] + 2
    # Nothing but the prefix cache's entries holds a lease.
    assert m["lloyal_kv_leases_free"] == 8 - m["lloyal_prefix_cache_entries"]
    assert m["lloyal_completion_tokens_total"] - before["lloyal_completion_tokens_total"] < 2000


async def _running(
    c: httpx.AsyncClient, stack: contextlib.AsyncExitStack, path: str, body: dict[str, Any]
) -> AsyncIterator[str]:
    """Start a streamed request and return its lines once the first token
    came back: from then on the request is admitted and running, and stays
    so until the rest of its (long, ``ignore_eos``) stream is read."""
    r = await stack.enter_async_context(c.stream("POST", path, json={**body, "stream": True}))
    assert r.status_code == 200
    lines = r.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            break
    return lines


async def _wait_for(c: httpx.AsyncClient, name: str, value: float) -> None:
    """Poll /metrics until ``name`` reads ``value`` (a hang guard, not a speed
    limit: the event it waits for follows one HTTP round trip)."""
    for _ in range(600):
        text = (await c.get("/metrics")).text
        if dict(line.split() for line in text.splitlines()).get(name) in (f"{value}", f"{value:g}"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never read {value}")


async def _drain(lines: AsyncIterator[str]) -> int:
    """Read a stream to its end; the number of content chunks in it."""
    return sum([1 async for line in lines if line.startswith("data: {")])


def test_overload_gets_429_and_concurrent_requests_share_decodes(tmp_path: Path) -> None:
    """One request runs (its two choices fill the two sequences the prefix
    cache leaves), one waits, the rest are told to come back. The running
    request is held by its stream (300 tokens to go), not by arrival
    timing, so the outcome is the same on a busy machine."""
    proc, url = _start(
        "--n-seq-max",
        "3",
        "--max-queue",
        "1",
        "--cache-branches",
        "1",
        "--cache-dir",
        str(tmp_path),
    )
    try:
        body: dict[str, Any] = {"messages": ASK, "max_tokens": 24, "n": 2, "temperature": 0}
        path = "/v1/chat/completions"

        async def burst() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                async with contextlib.AsyncExitStack() as stack:
                    long = {**body, "max_tokens": 300, "ignore_eos": True}
                    first = await _running(c, stack, path, long)
                    waiting = asyncio.create_task(c.post(path, json=body))
                    await _wait_for(c, "lloyal_requests_waiting", 1)
                    for _ in range(3):
                        r = await c.post(path, json=body)
                        assert r.status_code == 429, r.text
                        assert r.headers["Retry-After"]
                    # The first request was still running when the third was refused.
                    assert _metrics(url)["lloyal_requests_active"] == 1
                    assert await _drain(first) > 0
                assert (await waiting).status_code == 200

        before = _metrics(url)
        asyncio.run(burst())
        after = _metrics(url)
        assert (
            after["lloyal_requests_rejected_total"] - before["lloyal_requests_rejected_total"] == 3
        )
        generated = (
            after["lloyal_completion_tokens_total"] - before["lloyal_completion_tokens_total"]
        )
        decodes = after["lloyal_decode_calls_total"] - before["lloyal_decode_calls_total"]
        # Two choices per request decode together: fewer decodes than tokens.
        assert decodes < generated
        # Each finished request's first choice becomes the one cache entry
        # and pushes the one before out, to --cache-dir: the long request's
        # by the waiting one's, that one by another prompt's.
        other = {"messages": [{"role": "user", "content": "Something else."}], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/chat/completions", json=other).status_code == 200
        assert len(list(tmp_path.glob("*.state"))) == 2
    finally:
        _stop(proc)


def _tokens(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` plain-vocabulary tokens that differs from every
    other seed's from its first token."""
    return [1000 + (seed * 37 + j * 11) % 20000 for j in range(n)]


def _at_once(url: str, n: int, *, prompt: int, max_tokens: int) -> list[httpx.Response]:
    """``n`` completions of ``prompt`` tokens sent together, each asking for
    exactly ``max_tokens`` (end of generation ignored)."""

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            bodies = [
                {"prompt": _tokens(i, prompt), "max_tokens": max_tokens, "ignore_eos": True}
                for i in range(n)
            ]
            return list(await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies]))

    return asyncio.run(send())


# A hang guard, not a speed limit: 55,000 prompt tokens (plus the failed
# prefill that finds the cache full, before an entry is evicted) take a few
# minutes on a busy 2-core machine.
@pytest.mark.timeout(1200)
def test_sequential_long_prompts_evict_cached_prefixes_by_cells() -> None:
    """Default flags (8192 cells): fifty different 1,100-token prompts one
    after another all succeed. Each leaves a prefix-cache entry holding its
    cells; the next prompts evict them when the cache is full (before, the
    eighth and every later one got a permanent 400)."""
    proc, url = _start()
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            for i in range(50):
                body = {"prompt": _tokens(i, 1100), "max_tokens": 2, "temperature": 0}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, (i, r.text)
                assert r.json()["usage"]["prompt_tokens"] == 1100
    finally:
        _stop(proc)


def test_chats_that_each_fit_alone_all_reach_max_tokens() -> None:
    """Four concurrent requests of 204 + 200 tokens in 1024 cells: each is
    admitted with its cells reserved (two at a time), so every one reaches
    max_tokens instead of all ending early with "length" mid-way."""
    proc, url = _start("--n-ctx", "1024")
    try:
        for r in _at_once(url, 4, prompt=204, max_tokens=200):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 200
    finally:
        _stop(proc)


def test_a_burst_beyond_the_cells_gets_retryable_refusals() -> None:
    """2048 cells, one request allowed to wait: two requests of 300 + 700
    tokens run, one of 300 + 200 waits for cells, three more get 429 with
    Retry-After (never 400), and every admitted request completes in full.
    The two running requests are held by their streams, so the outcome does
    not depend on how fast the machine is."""
    proc, url = _start("--n-ctx", "2048", "--max-queue", "1")
    try:

        async def burst() -> None:
            def body(i: int, max_tokens: int) -> dict[str, Any]:
                return {"prompt": _tokens(i, 300), "max_tokens": max_tokens, "ignore_eos": True}

            async with httpx.AsyncClient(base_url=url, timeout=300) as c:
                async with contextlib.AsyncExitStack() as stack:
                    running = [
                        await _running(c, stack, "/v1/completions", body(i, 700)) for i in (0, 1)
                    ]
                    waiting = asyncio.create_task(c.post("/v1/completions", json=body(2, 200)))
                    await _wait_for(c, "lloyal_requests_waiting", 1)
                    for i in (3, 4, 5):
                        r = await c.post("/v1/completions", json=body(i, 200))
                        assert r.status_code == 429, r.text
                        assert r.headers["Retry-After"]
                        assert r.json()["error"]["type"] == "rate_limit_exceeded"
                    assert _metrics(url)["lloyal_requests_active"] == 2
                    assert [await _drain(lines) for lines in running] == [700, 700]
                r = await waiting
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 200

        asyncio.run(burst())
    finally:
        _stop(proc)
