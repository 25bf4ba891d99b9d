"""`lloyal serve` against the official openai client and raw HTTP.

The server runs as a subprocess (``python -m lloyal serve``) on SmolLM2,
so the CLI, the ASGI app and the engine are tested together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from lloyal.branch import Branch, BranchStore, Produced
from lloyal.server import ServerConfig, create_app
from lloyal.server import _openai as server_openai
from lloyal.server._choice import Choice

from tests import server_fuzz
from tests._hang import HANG_GUARD_S, deadline
from tests.server_fuzz import CHAT, COMPLETIONS, metrics, start_server, stop_server

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


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, url = start_server("--n-seq-max", "8", "--n-ctx", "4096")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_and_health(client: openai.OpenAI, server: str) -> None:
    (model,) = client.models.list().data
    assert model.id
    assert httpx.get(f"{server}/health", timeout=HANG_GUARD_S).json() == {"status": "ok"}


def test_chat_completion_with_n_choices_from_one_prompt(client: openai.OpenAI, server: str) -> None:
    before = metrics(server)
    r = client.chat.completions.create(
        model="anything", messages=ASK, max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage is not None
    assert r.usage.completion_tokens <= 18
    after = metrics(server)
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


def test_a_call_cut_by_max_tokens_streams_as_it_collects(client: openai.OpenAI) -> None:
    """A forced call cut by ``max_tokens``: ``finish_reason: "length"`` with
    the call and the arguments it got, streamed or not; its markup is never
    sent again as content (the finish chunk used to repeat it)."""
    cut = 0
    for max_tokens in (12, 16, 20, 24):
        kwargs: dict[str, Any] = {
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        whole = client.chat.completions.create(model="m", **kwargs).choices[0]
        calls = whole.message.tool_calls or []
        got = [(c.function.name, c.function.arguments) for c in calls]  # type: ignore[union-attr]
        content, names, arguments, finish = "", {}, {}, None
        for chunk in client.chat.completions.create(model="m", stream=True, **kwargs):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                names[tc.index] = tc.function.name or names.get(tc.index)  # type: ignore[union-attr]
                arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")  # type: ignore[union-attr]
            finish = chunk.choices[0].finish_reason or finish
        streamed = [(names[i], arguments[i]) for i in sorted(names)]
        assert (streamed, finish) == (got, whole.finish_reason), max_tokens
        assert content == (whole.message.content or ""), max_tokens
        assert "tool_call" not in content, max_tokens
        if whole.finish_reason == "tool_calls":
            assert got, max_tokens  # finished within max_tokens
        else:
            assert whole.finish_reason == "length", (max_tokens, whole)
            # Cut before the call was named: nothing; after: the cut call.
            cut += bool(got)
            assert all(name == "get_weather" for name, _ in got)
    assert cut, "some max_tokens cut the call"


def test_a_schema_that_says_nothing_of_other_keys_is_closed(client: openai.OpenAI) -> None:
    """Tool parameters and a response format without ``additionalProperties``
    are read as closed objects, as llama-server reads them: the model
    cannot add keys of its own (it did, until ``max_tokens`` cut the call:
    most clients leave the keyword out)."""
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    calls = 0
    for content in ("What is the weather in Paris?", "Weather for Tokyo and Lima, in detail?"):
        r = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": content}],
            tools=[tool],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        for call in r.choices[0].message.tool_calls or []:
            calls += 1
            assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
        assert r.choices[0].finish_reason == "tool_calls", r
    assert calls
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
    }
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert set(json.loads(r.choices[0].message.content or "")) == {"answer"}


def test_langchain_bind_tools_any_gets_a_call_with_its_own_keys(server: str) -> None:
    """LangChain's ``bind_tools(..., tool_choice="any")`` (a ``@tool``'s
    schema has no ``additionalProperties``): the call it gets back parses,
    with the tool's keys only. Before tool schemas were closed, the model
    added keys until ``max_tokens`` cut the call, which LangChain then
    listed as an invalid tool call (issue 47, item 5)."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(
        base_url=f"{server}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="m",
        temperature=0,
        max_tokens=80,  # type: ignore[call-arg]
        max_retries=0,
        timeout=HANG_GUARD_S,
    )
    tools = llm.bind_tools([get_weather], tool_choice="any")
    msg = tools.invoke("Weather for Tokyo and Lima, in detail?")
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls  # type: ignore[attr-defined]
    assert msg.tool_calls  # type: ignore[attr-defined]
    for call in msg.tool_calls:  # type: ignore[attr-defined]
        assert call["name"] == "get_weather"
        assert set(call["args"]) == {"city"}


def test_instructor_create_iterable_gets_whole_objects(server: str) -> None:
    """instructor's ``create_iterable`` (tool mode: a schema of a list of
    the model's objects, none with ``additionalProperties``) yields whole
    objects. It failed while such schemas were open: the model's invented
    keys ran into ``max_tokens`` (issue 47, item 5)."""
    import instructor
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    raw = openai.OpenAI(
        base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S
    )
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    cities = list(
        client.chat.completions.create_iterable(
            model="m",
            response_model=City,
            messages=[{"role": "user", "content": "Name two cities in France."}],
            max_tokens=80,
            temperature=0,
            max_retries=0,
        )
    )
    assert cities
    assert all(isinstance(c, City) and c.name for c in cities)
    raw.close()


def test_llama_servers_own_chat_fields_are_applied_or_refused(client: openai.OpenAI) -> None:
    """``n_predict``, ``json_schema`` and a GBNF ``grammar`` on a chat request
    (llama-server's fields) are applied, and what cannot go together is a
    400; ``tool_choice: "required"`` without tools is a 400. All were
    silently ignored."""
    short = client.chat.completions.create(
        model="m", messages=ASK, temperature=0, extra_body={"n_predict": 3}
    )
    assert short.usage is not None
    assert short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=30, temperature=0, extra_body={"json_schema": schema}
    )
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    r = client.chat.completions.create(
        model="m",
        messages=ASK,
        max_tokens=8,
        temperature=0,
        extra_body={"grammar": 'root ::= "sunny" | "rainy"'},
    )
    assert r.choices[0].message.content in ("sunny", "rainy")
    refused = [
        ({"grammar": "root ::= missing", "max_tokens": 4}, "grammar"),
        ({"grammar": 'root ::= "a"', "tools": [WEATHER]}, "grammar"),
        ({"json_schema": schema, "response_format": {"type": "json_object"}}, "json_schema"),
        ({"n_predict": 0}, "n_predict"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as e:  # noqa: PT012
            client.chat.completions.create(model="m", messages=ASK, extra_body=extra)
            pytest.fail(f"{extra} was taken")
        assert param in str(e.value), extra


def test_llama_servers_completion_and_slots(server: str) -> None:
    """``/completion`` (llama-server's native completion: ``n_predict``,
    streaming, a GBNF ``grammar`` or ``json_schema``) and ``/slots`` (one per
    lease); both were 404s."""
    url = f"{server}/completion"
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 4, "temperature": 0}
    whole = httpx.post(url, json=body, timeout=HANG_GUARD_S).json()
    assert whole["stop"] is True
    assert whole["tokens_predicted"] == 4
    assert whole["stop_type"] == "limit"
    assert whole["tokens_evaluated"] > 0
    r = httpx.post(url, json={**body, "stream": True}, timeout=HANG_GUARD_S)
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["stop"] is True
    picked = httpx.post(
        url, json={**body, "grammar": 'root ::= " five" | " six"'}, timeout=HANG_GUARD_S
    ).json()
    assert picked["content"] in (" five", " six")
    for bad, param in (
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"json_schema": 3}, "json_schema"),
        ({"n": 2}, "prompt"),
    ):
        r = httpx.post(url, json={**body, **bad}, timeout=HANG_GUARD_S)
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == param
    slots = httpx.get(f"{server}/slots", timeout=HANG_GUARD_S).json()
    assert [s["id"] for s in slots] == list(range(N_SEQ_MAX))
    assert all(isinstance(s["is_processing"], bool) for s in slots)


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
        (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{}]}', "tools"),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}',
            "response_format",
        ),
    ],
)
def test_bad_chat_requests_are_400(server: str, body: bytes, param: str | None) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", content=body, timeout=HANG_GUARD_S)
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
        r = httpx.post(f"{server}{path}", json=body, timeout=HANG_GUARD_S)
        assert r.status_code == 400, (path, body, r.text)
    assert httpx.get(f"{server}/v1/nothing", timeout=HANG_GUARD_S).status_code == 404
    # The server is still fine.
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=HANG_GUARD_S
    )
    assert r.status_code == 200


HI = b'[{"role": "user", "content": "Hi"}]'
C, P = CHAT, COMPLETIONS


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Token ids outside the vocabulary, or not ids at all: these reached
        # the native sampler (a 400 without param, or none at all for "+5").
        (C, b'{"messages": %s, "logit_bias": {"49152": 5}}' % HI, "logit_bias"),
        (P, b'{"prompt": "Hi", "logit_bias": {"99999999999": 1}}', "logit_bias"),
        (P, b'{"prompt": "Hi", "logit_bias": {"+5": 1}}', "logit_bias"),
        (P, b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', "logit_bias"),
        (P, b'{"prompt": "Hi", "logit_bias": {"5": Infinity}}', "logit_bias"),
        (P, b'{"prompt": "Hi", "logit_bias": 7}', "logit_bias"),
        (P, b'{"prompt": "Hi", "temperature": 1%s}' % (b"0" * 400), "temperature"),
        (P, b'{"prompt": "Hi", "top_p": 1e999}', "top_p"),
        (P, b'{"prompt": "Hi", "stop": "%s"}' % (b"x" * 1001), "stop"),
        (P, b'{"prompt": "Hi", "stream_options": {"include_usage": 1}}', "stream_options"),
        # Malformed messages: tool calls that are not a list of calls were
        # an AttributeError (a plain-text 500).
        (
            C,
            b'{"messages": [{"role": "assistant", "tool_calls": "get_weather"}]}',
            "messages",
        ),
        (C, b'{"messages": [{"role": "assistant", "tool_calls": [1]}]}', "messages"),
        (
            C,
            b'{"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}',
            "messages",
        ),
        (C, b'{"messages": %s, "tool_choice": "sometimes"}' % HI, "tool_choice"),
        (
            C,
            b'{"messages": %s, "response_format": {"type": "json_schema",'
            b' "json_schema": {"schema": {"type": "nothing"}}}}' % HI,
            "response_format",
        ),
        # Nested past Python's recursion limit: once a RecursionError.
        (C, b"[" * 100_000 + b"]" * 100_000, None),
        (P, b'{"prompt": %s}' % (b"[" * 200 + b"]" * 200), None),
    ],
)
def test_what_the_engine_would_refuse_is_a_400_naming_the_field(
    server: str, path: str, body: bytes, param: str | None
) -> None:
    r = httpx.post(f"{server}{path}", content=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


@contextlib.asynccontextmanager
async def _in_process(model: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The ASGI app in this process (so that a test can reach inside it),
    and a client of it; the app's state as the second item."""
    app = create_app(ServerConfig(model_path=model, n_seq_max=4, n_ctx=1024))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://x", timeout=HANG_GUARD_S
        ) as c:
            (state,) = app.state.lloyal.states().values()
            yield c, state


DOOMED_SEED = 13


def _fail_inside_the_step(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Make the branch of the request seeded with DOOMED_SEED fail inside
    the step loop, at its third token, in one of the ways nothing can check
    beforehand: its sampler raising (the batch call raises once the other
    branches have chosen, as BranchStore.produce does), the server's own
    code for its token raising, or its commit failing alone (the other
    items committed, as BranchStore.commit does)."""
    doomed: list[Branch] = []
    calls = {"produce": 0, "commit": 0}  # batched calls that held the doomed branch

    def reseed(self: Branch, seed: int, real: Any = Branch.reseed_sampler) -> None:
        if seed == DOOMED_SEED:
            doomed.append(self)
        real(self, seed)

    monkeypatch.setattr(Branch, "reseed_sampler", reseed)

    def is_doomed(b: Branch) -> bool:
        return any(b is d for d in doomed)

    if where == "produce":

        async def produce(self: Branch, real: Any = Branch.produce) -> Produced:
            if is_doomed(self):
                raise ValueError("injected: a sampler that cannot sample")
            return await real(self)

        async def produce_many(
            self: BranchStore, branches: list[Branch], *, return_exceptions: bool = False
        ) -> list[Any]:
            mine = any(is_doomed(b) for b in branches)
            calls["produce"] += mine
            out = await real_many(self, branches, return_exceptions=return_exceptions)
            if mine and calls["produce"] >= 3:
                raise ValueError("injected: a sampler that cannot sample")
            return out

        real_many = BranchStore.produce
        monkeypatch.setattr(BranchStore, "produce", produce_many)
        monkeypatch.setattr(Branch, "produce", produce)
    elif where == "decide":

        def decide(self: Any, p: Produced, lp: Any = None, real: Any = Choice.decide) -> Any:
            if self.gen.seed == DOOMED_SEED and self.made == 2:
                raise RuntimeError("injected: a bug in the server's code for one token")
            return real(self, p, lp)

        monkeypatch.setattr(Choice, "decide", decide)
    else:

        async def commit(
            self: BranchStore,
            items: list[tuple[Branch, int]],
            *,
            return_exceptions: bool = False,
            real: Any = BranchStore.commit,
        ) -> Any:
            mine = any(is_doomed(b) for b, _ in items)
            calls["commit"] += mine
            if not mine or calls["commit"] < 3:
                return await real(self, items, return_exceptions=return_exceptions)
            await real(self, [(b, t) for b, t in items if not is_doomed(b)])
            error = ValueError("injected: a commit that fails alone")
            if not return_exceptions:
                raise error
            return [error if is_doomed(b) else None for b, _ in items]

        monkeypatch.setattr(BranchStore, "commit", commit)


@pytest.mark.parametrize("where", ["produce", "decide", "commit"])
def test_a_request_failing_inside_the_step_ends_alone(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Two completions run in the shared step loop; a third joins them and
    fails inside a step. It alone gets an error (OpenAI's JSON body, 500);
    the other two reach their max_tokens, and every lease comes back.
    (Before, the step loop's catch-all ended every request with 500.)"""
    _fail_inside_the_step(monkeypatch, where)

    async def run() -> None:
        async with _in_process(smollm2) as (c, state):
            long = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
            running = [
                asyncio.create_task(c.post("/v1/completions", json={"prompt": p, **long}))
                for p in ("One, two, three,", "The capital of France is")
            ]
            give_up = deadline()  # a hang guard: both reach the step loop
            while len(state.engine._active) < 2:
                assert time.monotonic() < give_up, "the two requests never ran"
                await asyncio.sleep(0.01)
            body = {"prompt": "Once upon a time", "max_tokens": 50, "seed": DOOMED_SEED}
            body["ignore_eos"] = True
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["type"] == "server_error"
            assert "injected" in r.json()["error"]["message"]
            for done in await asyncio.gather(*running):
                assert done.status_code == 200, done.text
                assert done.json()["usage"]["completion_tokens"] == 100
            cache = state.engine.cache.stats.entries
            assert BranchStore(state.ctx).available == 4 - cache

    asyncio.run(run())


def test_an_unexpected_error_is_a_json_500(smollm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a route is still OpenAI's error body (Starlette's own
    answer is a plain-text 500), and the server goes on."""

    def broken(*args: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(server_openai, "prepare", broken)

    async def run() -> None:
        async with _in_process(smollm2) as (c, _):
            r = await c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "server_error"
            r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert (await c.get("/v1/nothing")).json()["error"]["message"]

    asyncio.run(run())


N_SEQ_MAX = 8  # the module's server's


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sent=server_fuzz.requests())
def test_fuzzed_requests_get_a_success_or_a_4xx(server: str, sent: tuple[str, bytes]) -> None:
    """Random bodies for both completion endpoints (tests/server_fuzz.py):
    a success or a 4xx with OpenAI's error body, never a 500; a good
    request right after each one succeeds, and then every lease is back."""
    with server_fuzz.Fuzzer(server, N_SEQ_MAX) as fuzzer:
        fuzzer.round(sent)


def test_a_client_that_disconnects_frees_its_branch(server: str) -> None:
    before = metrics(server)
    # ignore_eos (llama-server's extension): the answer cannot end early.
    body = {"messages": ASK, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=body, timeout=HANG_GUARD_S
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    # Meant to expire, not a hang guard: this client leaves after waiting
    # 1 s for a reply that takes 2000 tokens (longer still on a busy machine).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server}/v1/chat/completions",
            json={**body, "stream": False},
            timeout=httpx.Timeout(HANG_GUARD_S, read=1.0),
        )
    give_up = deadline()  # a hang guard: the server notices both departures
    while time.monotonic() < give_up:
        m = metrics(server)
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


@contextlib.contextmanager
def _serving(config: ServerConfig) -> Iterator[tuple[str, Any]]:
    """The app under uvicorn in a thread of this process (real sockets, so
    real disconnects), its URL and its state (to reach the context)."""
    import threading

    import uvicorn

    app = create_app(config)
    uv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", loop="asyncio")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    give_up = deadline()  # a hang guard: the model loads
    while not uv.started and thread.is_alive() and time.monotonic() < give_up:
        time.sleep(0.05)
    assert uv.started
    (sock,) = uv.servers[0].sockets
    (state,) = app.state.lloyal.states().values()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        uv.should_exit = True
        thread.join()


def test_clients_that_leave_during_their_prefill_cost_no_decode(smollm2: Path) -> None:
    """Six clients (three streaming) send 700-token prompts and leave while
    their prefills wait on the worker (held, so on a machine of any speed).
    Once the server has noticed them go, the worker is let go: it decodes
    none of their prompts, and nothing stays active. It used to decode
    every prompt for nobody and keep the requests active until it had
    (issue 48, item 8)."""
    config = ServerConfig(model_path=smollm2, n_seq_max=8, n_ctx=8192)
    with _serving(config) as (url, state):
        ctx = state.ctx
        before = metrics(url)
        hold = ctx._native.hold()
        try:
            for i in range(6):
                body = {
                    "prompt": _tokens(i, 700),
                    "max_tokens": 4,
                    "ignore_eos": True,
                    "stream": i % 2 == 0,
                }
                # Meant to expire, not a hang guard: the client leaves.
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(
                        f"{url}/v1/completions",
                        json=body,
                        timeout=httpx.Timeout(HANG_GUARD_S, read=0.5),
                    )
            give_up = deadline()  # a hang guard: each departure is seen in 0.1 s
            while time.monotonic() < give_up:
                m = metrics(url)
                gone = (
                    m["lloyal_client_disconnects_total"] - before["lloyal_client_disconnects_total"]
                )
                if gone >= 6:
                    break
                time.sleep(0.1)
            assert gone == 6
        finally:
            hold.release()
        give_up = deadline()  # a hang guard: the worker clears what was given up
        while time.monotonic() < give_up and metrics(url)["lloyal_requests_active"]:
            time.sleep(0.1)
        after = metrics(url)
        assert after["lloyal_requests_active"] == 0
        assert after["lloyal_tokens_decoded_total"] == before["lloyal_tokens_decoded_total"]
        # The server goes on as before.
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": _tokens(9, 50), "max_tokens": 2},
            timeout=HANG_GUARD_S,
        )
        assert r.status_code == 200, r.text


async def _running(
    c: httpx.AsyncClient, stack: contextlib.AsyncExitStack, path: str, body: dict[str, Any]
) -> AsyncIterator[str]:
    """Start a streamed request and return its lines once the first token
    came back: from then on the request is admitted and running, and stays
    so until the rest of its (long, ``ignore_eos``) stream is read."""
    usage = {"stream_options": {"include_usage": True}}
    r = await stack.enter_async_context(
        c.stream("POST", path, json={**body, "stream": True, **usage})
    )
    assert r.status_code == 200
    lines = r.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            break
    return lines


async def _wait_for(c: httpx.AsyncClient, name: str, value: float) -> None:
    """Poll /metrics until ``name`` reads ``value`` (a hang guard, not a speed
    limit: the event it waits for follows one HTTP round trip)."""
    give_up = deadline()
    while time.monotonic() < give_up:
        text = (await c.get("/metrics")).text
        if dict(line.split() for line in text.splitlines()).get(name) in (f"{value}", f"{value:g}"):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never read {value}")


async def _drain(lines: AsyncIterator[str]) -> int:
    """Read a stream to its end; the tokens it generated, from its usage
    chunk. (Not its chunks: a token that ends inside a character streams
    no text, and sampled text has such tokens now and then.)"""
    made = -1
    async for line in lines:
        if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
            made = usage["completion_tokens"]
    return made


def test_overload_gets_429_and_concurrent_requests_share_decodes(tmp_path: Path) -> None:
    """One request runs (its two choices fill the two sequences the prefix
    cache leaves), one waits, the rest are told to come back. The running
    request is held by its stream (300 tokens to go), not by arrival
    timing, so the outcome is the same on a busy machine."""
    proc, url = start_server(
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
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c:
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
                    assert metrics(url)["lloyal_requests_active"] == 1
                    assert await _drain(first) > 0
                assert (await waiting).status_code == 200

        before = metrics(url)
        asyncio.run(burst())
        after = metrics(url)
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
        r = httpx.post(f"{url}/v1/chat/completions", json=other, timeout=HANG_GUARD_S)
        assert r.status_code == 200
        assert len(list(tmp_path.glob("*.state"))) == 2
    finally:
        stop_server(proc)


def _tokens(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` plain-vocabulary tokens that differs from every
    other seed's from its first token."""
    return [1000 + (seed * 37 + j * 11) % 20000 for j in range(n)]


def _at_once(url: str, n: int, *, prompt: int, max_tokens: int) -> list[httpx.Response]:
    """``n`` completions of ``prompt`` tokens sent together, each asking for
    exactly ``max_tokens`` (end of generation ignored)."""

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c:
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
    proc, url = start_server()
    try:
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as c:
            for i in range(50):
                body = {"prompt": _tokens(i, 1100), "max_tokens": 2, "temperature": 0}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, (i, r.text)
                assert r.json()["usage"]["prompt_tokens"] == 1100
    finally:
        stop_server(proc)


def test_chats_that_each_fit_alone_all_reach_max_tokens() -> None:
    """Four concurrent requests of 204 + 200 tokens in 1024 cells: each is
    admitted with its cells reserved (two at a time), so every one reaches
    max_tokens instead of all ending early with "length" mid-way."""
    proc, url = start_server("--n-ctx", "1024")
    try:
        for r in _at_once(url, 4, prompt=204, max_tokens=200):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 200
    finally:
        stop_server(proc)


def test_a_burst_beyond_the_cells_gets_retryable_refusals() -> None:
    """2048 cells, one request allowed to wait: two requests of 300 + 700
    tokens run, one of 300 + 200 waits for cells, three more get 429 with
    Retry-After (never 400), and every admitted request completes in full.
    The two running requests are held by their streams, so the outcome does
    not depend on how fast the machine is."""
    proc, url = start_server("--n-ctx", "2048", "--max-queue", "1")
    try:

        async def burst() -> None:
            def body(i: int, max_tokens: int) -> dict[str, Any]:
                return {"prompt": _tokens(i, 300), "max_tokens": max_tokens, "ignore_eos": True}

            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as c:
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
                    assert metrics(url)["lloyal_requests_active"] == 2
                    assert [await _drain(lines) for lines in running] == [700, 700]
                r = await waiting
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 200

        asyncio.run(burst())
    finally:
        stop_server(proc)


def test_prompts_prefilled_together_start_streaming_together(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose prompt is in while another request's longer prompt
    is still being prefilled starts streaming once that one is in too (as
    a burst would in llama-server), so its first tokens do not wait behind
    the other prompt's chunks; while choices stream, the context's step
    budget is the server's (``--step-tokens``), and with none streaming it
    is back to ``n_batch``."""
    from lloyal.server._engine import Scheduler
    from lloyal.server._state import DEFAULT_STEP_TOKENS

    seen: dict[str, list[Any]] = {"pending": [], "budget": []}
    real_start, real_commit = Scheduler._start, Scheduler._commit

    async def start(self: Scheduler, choices: list[Choice]) -> None:
        seen["pending"].append(len(self._prefilling))
        await real_start(self, choices)

    async def commit(self: Scheduler, batch: list[tuple[Choice, int]]) -> None:
        seen["budget"].append(self.ctx.step_tokens)
        await real_commit(self, batch)

    monkeypatch.setattr(Scheduler, "_start", start)
    monkeypatch.setattr(Scheduler, "_commit", commit)
    long = " ".join(f"item {i}," for i in range(150))  # ~600 tokens: two rounds of 512

    async def run() -> None:
        async with _in_process(smollm2) as (c, state):
            bodies = [
                {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}
                for text in ("Hi.", f"Repeat: {long}")
            ]
            replies = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=b) for b in bodies)
            )
            assert [r.status_code for r in replies] == [200, 200]
            assert state.engine.ctx.step_tokens is None

    asyncio.run(run())
    # The short prompt was in after the first round; it started when the
    # long one was in as well: no prompt was pending at either start.
    assert seen["pending"] == [0, 0]
    assert seen["budget"]
    assert set(seen["budget"]) == {DEFAULT_STEP_TOKENS}
