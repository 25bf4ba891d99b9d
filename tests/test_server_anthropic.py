"""`lloyal serve` through Anthropic's Messages API, with the official
``anthropic`` SDK (a subprocess on SmolLM2, deterministic so that a
streamed and a whole reply are the same tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from lloyal.models import model_path

from tests import server_fuzz
from tests._hang import HANG_GUARD_S
from tests.conftest import open_sync
from tests.server_fuzz import start_server, stop_server

WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
# The SDK has no sampling fields any more; the server reads them if sent.
GREEDY = {"temperature": 0}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--n-seq-max", "4", "--n-ctx", "2048", "--deterministic")
    yield url
    stop_server(proc)


@pytest.fixture
def client(server: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0) as c:
        yield c


def test_a_message_whole_and_streamed(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {
        "model": "m",
        "max_tokens": 12,
        "extra_body": GREEDY,
        "system": "You are brief.",
        "messages": [{"role": "user", "content": "Name a colour."}],
    }
    whole = client.messages.create(**kw)
    assert whole.role == "assistant"
    assert whole.type == "message"
    (block,) = whole.content
    assert block.type == "text"
    assert block.text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0
    assert whole.usage.output_tokens > 0
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text
    assert final.content[0].type == "text"
    assert final.content[0].text == block.text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_round_trip(client: anthropic.Anthropic) -> None:
    call: dict[str, Any] = {
        "model": "m",
        "max_tokens": 60,
        "extra_body": GREEDY,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": ASK,
    }
    first = client.messages.create(**call)
    assert first.stop_reason == "tool_use"
    calls = [b for b in first.content if b.type == "tool_use"]
    assert calls
    assert calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict)
    assert "city" in calls[0].input
    # Streamed, the same call, its input in input_json_delta pieces.
    with client.messages.stream(**call) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed] == [(b.name, b.input) for b in calls]
    # The result goes back and the model answers.
    reply = client.messages.create(
        model="m",
        max_tokens=16,
        extra_body=GREEDY,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},  # type: ignore[typeddict-item]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}
                ],
            },
        ],
    )
    assert reply.content


def test_count_tokens_and_errors(client: anthropic.Anthropic, server: str) -> None:
    counted = client.messages.count_tokens(model="m", messages=ASK)
    # The route is up.
    plain = httpx.post(f"{server}/tokenize", json={"content": "x"}, timeout=HANG_GUARD_S)
    assert plain.status_code == 200
    assert counted.input_tokens > 5
    more = client.messages.count_tokens(model="m", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    assert more.input_tokens > counted.input_tokens, "the tools are in the prompt"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="m", max_tokens=4, messages=[{"role": "system", "content": "x"}]
        )  # type: ignore[misc,list-item]
    assert "role" in str(e.value)
    # Anthropic's error body, raw.
    r = httpx.post(f"{server}/v1/messages", json={"messages": ASK}, timeout=HANG_GUARD_S)
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_streamed_events_in_order(server: str) -> None:
    body = {"model": "m", "max_tokens": 6, "stream": True, "messages": ASK}
    r = httpx.post(f"{server}/v1/messages", json=body, timeout=HANG_GUARD_S)
    kinds = [
        json.loads(line[len("data: ") :])["type"]
        for line in r.text.splitlines()
        if line.startswith("data: ")
    ]
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    events = [line for line in r.text.splitlines() if line.startswith("event: ")]
    assert len(events) == len(kinds), "each data line has its event line"


def test_a_stop_sequence_is_named_and_cached_input_counted_apart(
    client: anthropic.Anthropic,
) -> None:
    kw: dict[str, Any] = {
        "model": "m",
        "max_tokens": 16,
        "extra_body": GREEDY,
        "messages": [{"role": "user", "content": "Describe the sea in a sentence."}],
    }
    full = client.messages.create(**kw)
    (block,) = full.content
    assert block.type == "text"
    assert len(block.text) >= 6, block
    stop = block.text[len(block.text) // 2 :][:2]
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence"
    assert cut.stop_sequence == stop
    assert cut.content[0].type == "text"
    assert cut.content[0].text == block.text[: block.text.find(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    # The same prompt again: read from the prefix cache, counted apart.
    assert cut.usage.cache_read_input_tokens
    total = cut.usage.input_tokens + cut.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model="m", messages=kw["messages"])
    assert total == counted.input_tokens


def test_a_call_cut_by_max_tokens_is_a_cut_call_streamed_or_not(
    client: anthropic.Anthropic,
) -> None:
    """A forced call that ``max_tokens`` cuts off is a ``tool_use`` block
    with the input it got and ``stop_reason: "max_tokens"``, the same
    streamed as whole; never its markup as text, never ``tool_use`` as
    the stop reason (an agent loop keyed on it would run the tool on cut
    input). Found with the SDK: the stream ended ``tool_use`` and sent the
    raw call again as text."""
    cut = 0
    for max_tokens in (12, 16, 20, 24):
        call: dict[str, Any] = {
            "model": "m",
            "max_tokens": max_tokens,
            "extra_body": GREEDY,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": ASK,
        }
        whole = client.messages.create(**call)
        with client.messages.stream(**call) as stream:
            final = stream.get_final_message()

        def shape(m: anthropic.types.Message) -> list[tuple[str, Any]]:
            return [
                (b.type, (b.name, b.input) if b.type == "tool_use" else getattr(b, "text", ""))
                for b in m.content
            ]

        assert shape(final) == shape(whole), max_tokens
        assert final.stop_reason == whole.stop_reason, max_tokens
        assert not any("tool_call" in b.text for b in whole.content if b.type == "text")
        calls = [b for b in whole.content if b.type == "tool_use"]
        if whole.stop_reason == "tool_use":
            assert calls, max_tokens  # finished within max_tokens
        else:
            assert whole.stop_reason == "max_tokens", (max_tokens, whole)
            # Cut before the call was named: nothing; after: the cut call.
            cut += bool(calls)
            assert all(c.name == "get_weather" and isinstance(c.input, dict) for c in calls)
    assert cut, "some max_tokens cut the call"


def test_a_final_assistant_message_is_continued(client: anthropic.Anthropic) -> None:
    """A final assistant message is a prefill: the reply continues its text
    (the usual way to force a format), and the prompt is the chat up to the
    assistant's opener, then that text (it used to be closed as a turn of
    its own, and a new one opened after it)."""
    lead = "The capital of France is"
    chat: list[Any] = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": lead},
    ]
    reply = client.messages.create(model="m", max_tokens=4, extra_body=GREEDY, messages=chat)
    assert reply.content[0].type == "text"
    assert "Paris" in reply.content[0].text
    assert not reply.content[0].text.startswith(lead)
    ctx = open_sync(model_path("smollm2"), n_ctx=512)
    try:
        expected = ctx.tokenize_sync(ctx.format_chat(chat[:1]).prompt + lead)
    finally:
        ctx.close()
    counted = client.messages.count_tokens(model="m", messages=chat)
    assert counted.input_tokens == len(expected)


def test_structured_output_through_the_sdks_parse(client: anthropic.Anthropic) -> None:
    """``messages.parse(output_format=Model)`` sends ``output_config.format``:
    the reply is constrained to the schema (it used to be ignored, and the
    SDK failed to validate prose)."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str

    parsed = client.messages.parse(
        model="m",
        max_tokens=40,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Name a large city."}],
        output_format=City,
    )
    assert isinstance(parsed.parsed_output, City)
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        client.messages.create(
            model="m",
            max_tokens=4,
            messages=ASK,
            extra_body={"output_config": {"format": {"type": "xml"}}},
        )


def test_documents_and_many_stop_sequences(client: anthropic.Anthropic) -> None:
    """Plain-text ``document`` blocks reach the model under their title; a
    PDF is a clear 400 (not read here); more than OpenAI's 4
    ``stop_sequences`` are taken (all were 400s)."""
    note = "The secret word is PINEAPPLE."
    doc = {
        "type": "document",
        "title": "Note",
        "source": {"type": "text", "media_type": "text/plain", "data": note},
    }
    ask = {"type": "text", "text": "What is the secret word?"}
    plain = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": [ask]}])
    with_doc = client.messages.count_tokens(
        model="m",
        messages=[{"role": "user", "content": [doc, ask]}],  # type: ignore[list-item]
    )
    assert with_doc.input_tokens > plain.input_tokens + 5
    encoded = {
        **doc,
        "source": {
            "type": "base64",
            "media_type": "text/plain",
            "data": "VGhlIHNlY3JldCB3b3JkIGlzIFBJTkVBUFBMRS4=",
        },
    }
    same = client.messages.count_tokens(
        model="m",
        messages=[{"role": "user", "content": [encoded, ask]}],  # type: ignore[list-item]
    )
    assert same.input_tokens == with_doc.input_tokens
    pdf = {**doc, "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    with pytest.raises(anthropic.BadRequestError, match="plain-text"):
        client.messages.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": [pdf, ask]}],  # type: ignore[list-item]
        )
    stops = [f"<stop{i}>" for i in range(10)]
    r = client.messages.create(
        model="m", max_tokens=4, extra_body=GREEDY, messages=ASK, stop_sequences=stops
    )
    assert r.stop_reason in ("end_turn", "max_tokens", "stop_sequence")


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=server_fuzz.anthropic_requests())
def test_fuzzed_requests_get_a_message_or_a_4xx(server: str, sent: tuple[str, bytes]) -> None:
    """Random ``/v1/messages`` bodies (tests/server_fuzz.py): a message or a
    4xx with Anthropic's error body, never a 500; a good request right
    after each succeeds, and then every lease is back."""
    with server_fuzz.Fuzzer(server, 4) as fuzzer:
        fuzzer.round(sent)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=server_fuzz.llama_requests())
def test_fuzzed_llama_completions_get_a_reply_or_a_4xx(
    server: str, sent: tuple[str, bytes]
) -> None:
    """Random bodies for llama-server's ``/completion`` (tests/server_fuzz.py)."""
    with server_fuzz.Fuzzer(server, 4) as fuzzer:
        fuzzer.round(sent)
