"""`lloyal serve` through OpenAI's Responses API, with the official
``openai`` SDK (a subprocess on SmolLM2, deterministic so that a streamed
and a whole reply are the same tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings

from tests import server_fuzz
from tests._hang import HANG_GUARD_S
from tests.server_fuzz import start_server, stop_server

WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--n-seq-max", "4", "--n-ctx", "2048", "--deterministic")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_a_response_whole_and_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "m",
        "instructions": "You are brief.",
        "input": "Name a colour.",
        "max_output_tokens": 12,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    assert whole.object == "response"
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text
    assert whole.usage is not None
    assert whole.usage.input_tokens > 0
    assert whole.usage.output_tokens > 0
    kinds: list[str] = []
    text = ""
    final = None
    with client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
            if event.type == "response.incomplete":
                final = event.response  # the SDK finalizes only a completed one
        if final is None:
            final = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert text == whole.output_text == final.output_text
    assert final.status == whole.status
    assert final.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_tool_round_trip_through_previous_response_id(client: openai.OpenAI) -> None:
    forced: dict[str, Any] = {
        "model": "m",
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    first = client.responses.create(**forced)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    # Streamed, the same call.
    with client.responses.stream(**forced) as stream:
        args = "".join(
            e.delta for e in stream if e.type == "response.function_call_arguments.delta"
        )
        again = stream.get_final_response()
    assert args == calls[0].arguments
    streamed = [i for i in again.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(calls[0].name, calls[0].arguments)]
    # The result goes back on the stored conversation and the model answers.
    reply = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=16,
        temperature=0,
    )
    assert reply.previous_response_id == first.id
    # An answer, or (Gemma 3, the tools still offered) another call.
    assert reply.output_text or any(i.type == "function_call" for i in reply.output)
    assert reply.usage is not None
    assert first.usage is not None
    assert reply.usage.input_tokens > first.usage.input_tokens


def test_structured_output_through_the_sdks_parse(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str
        country: str

    parsed = client.responses.parse(
        model="m",
        input="Name a large city.",
        text_format=City,
        max_output_tokens=40,
        temperature=0,
    )
    assert isinstance(parsed.output_parsed, City)


def test_a_stored_conversation_retrieved_counted_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="m", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input="What is my name?",
        max_output_tokens=8,
        temperature=0,
    )
    alone = client.responses.input_tokens.count(model="m", input="What is my name?")
    chained = client.responses.input_tokens.count(
        model="m", previous_response_id=first.id, input="What is my name?"
    )
    assert chained.input_tokens > alone.input_tokens
    assert second.usage is not None
    assert second.usage.input_tokens == chained.input_tokens
    got = client.responses.retrieve(first.id)
    assert (got.id, got.output_text) == (first.id, first.output_text)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id=first.id, input="Hi")
    unstored = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "bogus"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": 5}, "previous_response_id"),
    ],
)
def test_bad_requests_are_400s(server: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server}/v1/responses", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_openai_agents_sdk_agent_with_a_function_tool(server: str) -> None:
    """An OpenAI Agents SDK agent (its default model speaks the Responses
    API) runs against ``lloyal serve``: it calls its function tool, gets the
    result back and answers."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return "Sunny, 21 C"

    async def main() -> Any:
        async with openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key="unused", max_retries=0
        ) as client:
            return await run(client)

    async def run(client: openai.AsyncOpenAI) -> Any:
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIResponsesModel(model="m", openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", temperature=0, max_tokens=60, parallel_tool_calls=False
            ),
            tools=[get_weather],
        )
        return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(main())
    assert calls, "the agent called its tool"
    assert isinstance(result.final_output, str)
    assert result.final_output


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=server_fuzz.responses_requests())
def test_fuzzed_requests_get_a_response_or_a_4xx(server: str, sent: tuple[str, bytes]) -> None:
    """Random ``/v1/responses`` bodies (tests/server_fuzz.py): a response or
    a 4xx with OpenAI's error body, never a 500; a good request right after
    each succeeds, and then every lease is back."""
    with server_fuzz.Fuzzer(server, 4) as fuzzer:
        fuzzer.round(sent)


@pytest.fixture(scope="module")
def gemma3_client() -> Iterator[openai.OpenAI]:
    """``lloyal serve`` on the other test model (Gemma 3, its template)."""
    from lloyal.models import model_path

    proc, url = start_server(
        "--model", str(model_path("gemma3")), "--template", "gemma",
        "--n-seq-max", "4", "--n-ctx", "2048", "--deterministic",
    )  # fmt: skip
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c
    stop_server(proc)


@pytest.mark.parametrize(
    "check",
    [
        test_a_response_whole_and_streamed,
        test_a_tool_round_trip_through_previous_response_id,
        test_structured_output_through_the_sdks_parse,
        test_a_stored_conversation_retrieved_counted_and_deleted,
    ],
    ids=lambda f: f.__name__.removeprefix("test_"),
)
def test_the_same_on_gemma3(gemma3_client: openai.OpenAI, check: Any) -> None:
    check(gemma3_client)
