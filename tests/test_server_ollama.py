"""`lloyal serve` through Ollama's API, with the official ``ollama`` client
(a subprocess on SmolLM2, deterministic so that a streamed and a whole
reply are the same tokens)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import ollama
import pytest
from hypothesis import HealthCheck, given, settings

from tests import server_fuzz
from tests._hang import HANG_GUARD_S, deadline
from tests.server_fuzz import start_server, stop_server

GREEDY = {"temperature": 0, "num_predict": 12}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def get_weather(city: str) -> str:
    """The weather in a city now.

    Args:
      city: The city's name.
    """
    return "Sunny"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--n-seq-max", "4", "--n-ctx", "2048", "--deterministic")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[ollama.Client]:
    with ollama.Client(host=server) as c:
        yield c


def test_chat_whole_and_streamed(client: ollama.Client) -> None:
    whole = client.chat(model="smollm2", messages=ASK, options=GREEDY, stream=False)
    assert whole.done
    assert whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant"
    assert whole.message.content
    assert whole.prompt_eval_count
    assert whole.eval_count
    parts = list(client.chat(model="smollm2", messages=ASK, options=GREEDY, stream=True))
    assert parts[-1].done
    assert not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    generated = client.generate(model="smollm2", prompt="Name a colour.", options=GREEDY)
    assert generated.done
    assert generated.response


def test_structured_output_and_tools(client: ollama.Client, server: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = client.chat(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a large city."}],
        format=schema,
        options={"temperature": 0, "num_predict": 30},
    )
    jsonschema.validate(json.loads(r.message.content or ""), schema)
    # Ollama cannot force a call and SmolLM2 answers this in prose: lloyal's
    # tool_choice extension forces it, and the client's own type reads it.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    forced = {
        "model": "smollm2",
        "messages": ASK,
        "tools": [tool],
        "tool_choice": "required",
        "stream": False,
        "options": {"temperature": 0, "num_predict": 60},
    }
    raw = httpx.post(f"{server}/api/chat", json=forced, timeout=HANG_GUARD_S)
    called = ollama.ChatResponse.model_validate(raw.json())
    calls = called.message.tool_calls or []
    assert calls, called
    assert calls[0].function.name == "get_weather"
    assert isinstance(calls[0].function.arguments, dict)
    # The result goes back as a tool message and the model answers.
    answer = client.chat(
        model="smollm2",
        messages=[
            *ASK,
            called.message,
            {"role": "tool", "content": "Sunny", "tool_name": "get_weather"},
        ],
        tools=[get_weather],
        options=GREEDY,
    )
    assert answer.done


def test_embeddings_list_show_ps_version(client: ollama.Client, server: str) -> None:
    e = client.embed(model="smollm2", input=["a cat sat", "a kitten sat", "tax law"])
    rows = e.embeddings
    assert len(rows) == 3

    def dot(a: Any, b: Any) -> float:
        return float(sum(x * y for x, y in zip(a, b, strict=True)))

    assert dot(rows[0], rows[1]) > dot(rows[0], rows[2])
    listed = client.list()
    assert len(listed.models) == 1
    assert listed.models[0].model
    shown = client.show("smollm2")
    assert shown.details is not None
    assert shown.details.format == "gguf"
    assert "completion" in (shown.capabilities or [])
    assert client.ps().models
    version = httpx.get(f"{server}/api/version", timeout=HANG_GUARD_S).json()
    assert version["version"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": ASK, "format": 5}, "format"),
        ({"model": "m", "messages": ASK, "options": {"num_predict": 0}}, "num_predict"),
        ({"model": "m", "messages": ASK, "keep_alive": "soon"}, "keep_alive"),
        ({"model": "m", "messages": ASK, "think": "very"}, "think"),
        ({"model": "m", "messages": ASK, "stream": "yes"}, "stream"),
    ],
)
def test_bad_requests_are_400s_in_ollamas_shape(
    server: str, body: dict[str, Any], says: str
) -> None:
    r = httpx.post(f"{server}/api/chat", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400
    assert says in r.json()["error"]


def test_the_client_reads_a_400(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError, match="num_predict") as e:
        client.chat(model="m", messages=ASK, options={"num_predict": 0})
    assert e.value.status_code == 400


def test_keep_alive_zero_closes_the_model_after_the_request(client: ollama.Client) -> None:
    """``keep_alive: 0`` closes the model once answered (Ollama unloads it);
    the next request opens it again."""
    client.chat(model="smollm2", messages=ASK, options={"num_predict": 1}, keep_alive=0)
    # It closes once the answer is sent, which may be just after the client
    # read it: a hang guard, not a speed check.
    give_up = deadline()
    while client.ps().models:
        assert time.monotonic() < give_up, "the model was not closed"
        time.sleep(0.05)
    again = client.chat(model="smollm2", messages=ASK, options={"num_predict": 1})
    assert again.done
    assert client.ps().models


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=server_fuzz.ollama_requests())
def test_fuzzed_requests_get_a_reply_or_a_4xx(server: str, sent: tuple[str, bytes]) -> None:
    """Random ``/api/chat`` bodies (tests/server_fuzz.py): a reply or a 4xx
    with Ollama's error body, never a 500; a good request right after each
    succeeds, and then every lease is back."""
    with server_fuzz.Fuzzer(server, 4) as fuzzer:
        fuzzer.round(sent)


@pytest.fixture(scope="module")
def gemma3_server() -> Iterator[str]:
    """``lloyal serve`` on the other test model (Gemma 3, its template)."""
    from lloyal.models import model_path

    proc, url = start_server(
        "--model", str(model_path("gemma3")), "--template", "gemma",
        "--n-seq-max", "4", "--n-ctx", "2048", "--deterministic",
    )  # fmt: skip
    yield url
    stop_server(proc)


@pytest.mark.parametrize(
    "check",
    [test_chat_whole_and_streamed, test_structured_output_and_tools],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_the_same_on_gemma3(gemma3_server: str, check: Any) -> None:
    with ollama.Client(host=gemma3_server, timeout=HANG_GUARD_S) as c:
        if "server" in check.__code__.co_varnames[: check.__code__.co_argcount]:
            check(c, gemma3_server)
        else:
            check(c)
