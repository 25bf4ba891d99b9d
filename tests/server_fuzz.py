"""A `lloyal serve` subprocess, and a fuzzer of its request schema.

Shared by tests/test_server.py (a short run) and bench/fuzz_server.py (a
long one). The fuzzer sends bodies built field by field from the OpenAI
schema, each field either a value the server takes or any JSON value at
all (NaN, infinities, lone surrogates and huge integers included), plus
bodies that are not JSON objects or are nested far past any parser's
depth. The contract (:meth:`Fuzzer.round`): every response is a success or
a 4xx with OpenAI's JSON error body, never a 5xx, a good request sent right
after each one succeeds, and then every KV lease is back. Every valid body asks for at most 4 tokens
per choice, so a round takes a fraction of a second on SmolLM2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx
from hypothesis import strategies as st

from tests._hang import HANG_GUARD_S, deadline

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
OLLAMA_CHAT = "/api/chat"
MESSAGES = "/v1/messages"
LLAMA_COMPLETION = "/completion"
GOOD: dict[str, dict[str, Any]] = {
    OLLAMA_CHAT: {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": False,
        "options": {"num_predict": 2},
    },
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 2},
    RESPONSES: {"input": "Hi", "max_output_tokens": 2},
    MESSAGES: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    LLAMA_COMPLETION: {"prompt": "Hi", "n_predict": 2},
}
VOCAB = 49152  # SmolLM2's: token ids on both sides of its end are tried


# -- the server -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m lloyal serve`` with ``args`` on a free port, once it is
    healthy; the process and its URL."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lloyal", "serve", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    # A hang guard, not a speed check: startup loads the model.
    give_up = deadline()
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            stop_server(proc)
            raise RuntimeError("the server died at startup")
        try:
            # One probe's limit only ends a probe the server is too busy to
            # answer; the next one follows. The deadline is the guard.
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"the server did not start in {HANG_GUARD_S:g} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        # Not a test bound: a server slow to stop is killed instead.
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=HANG_GUARD_S).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines())}


def leases_back(url: str, n_seq_max: int) -> dict[str, float]:
    """``/metrics`` once no request is active and nothing but the prefix
    cache's entries holds a lease; raises if that does not happen before
    the hang guard (tests/_hang.py): a streamed request frees its branches
    just after its last chunk."""
    give_up = deadline()
    while True:
        m = metrics(url)
        free = n_seq_max - m["lloyal_prefix_cache_entries"]
        if m["lloyal_requests_active"] == 0 and m["lloyal_kv_leases_free"] == free:
            return m
        if time.monotonic() > give_up:
            raise AssertionError(f"leases lost: {free} should be free, /metrics: {m}")
        time.sleep(0.1)


# -- the strategies ----------------------------------------------------------------

TEXT = st.text(max_size=12) | st.sampled_from(
    ["", "\x00", "<|im_end|>", "<|im_start|>user", "{{ x }}", "{%", " 7", "+7", "1e3", "-1"]
)
# Any JSON value, text with lone surrogates included. JSON has no NaN or
# infinity, but Python's parser (and so the server's) takes them.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | TEXT
    | st.sampled_from(["\ud800", "x\udfff"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
ABSENT = object()
"""A broken field's value that leaves the field out."""

Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]
"""A field's values: ones the server takes, and any others."""


@st.composite
def _record(
    draw: st.DrawFn,
    fields: dict[str, Field],
    required: tuple[str, ...] = (),
    breaks: tuple[int, int] = (0, 2),
) -> dict[str, Any]:
    """An object with the ``required`` fields and some of the others, valid
    but for ``breaks`` fields (each broken one junk, or absent)."""
    names = [*required, *(n for n in fields if n not in required and draw(st.booleans()))]
    out = {name: draw(fields[name][0]) for name in names}
    lo, hi = breaks
    broken = st.lists(st.sampled_from(sorted(fields)), min_size=lo, max_size=hi, unique=True)
    for name in draw(broken):
        value = draw(fields[name][1])
        if value is ABSENT:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def _whole(fields: dict[str, Field], required: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    return _record(fields, required, breaks=(0, 0))


def _broken(fields: dict[str, Field], required: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """Junk, or the object with one or two of its fields broken."""
    return JSON | _record(fields, required, breaks=(1, 2))


def _flag() -> Field:
    return st.booleans(), JSON


def _number(lo: float, hi: float) -> Field:
    return st.floats(lo, hi), JSON | st.sampled_from([lo - 1, hi + 1, 10**400, 1e400, "1"])


# A count a valid body has is 1 to 4; a broken one is never absent or null
# (no limit) nor a larger valid count, so any body ends within 4 tokens.
_BAD_COUNT = (
    st.integers(max_value=0)
    | st.integers(min_value=2**20 + 1)
    | JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int)))
)
_SCHEMAS = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"],
    },
    {"type": "string", "maxLength": 3},
    True,
]
# Well-formed schemas no reply can match, and malformed ones.
_BAD_SCHEMAS = [{"enum": []}, False, {"type": "nothing"}, {"properties": 5}, {"$ref": "#/x"}]
SCHEMA: Field = (st.sampled_from(_SCHEMAS), JSON | st.sampled_from(_BAD_SCHEMAS))
_NAMES = ["get_weather", "f"]
_TOKEN = st.integers(0, VOCAB - 1)
_BAD_TOKEN = st.integers(max_value=-1) | st.integers(min_value=VOCAB)

SAMPLING: dict[str, Field] = {
    "max_tokens": (st.integers(1, 4), _BAD_COUNT),
    "max_completion_tokens": (st.integers(1, 4) | st.none(), _BAD_COUNT),
    "model": (TEXT, JSON),
    "n": (st.integers(1, 4), JSON),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "top_k": (st.integers(0, 100), JSON),
    "min_p": _number(0, 1),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "seed": (st.integers(-(2**63), 2**64 - 1), JSON | st.integers()),
    "stop": (
        st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=4),
        JSON | st.just("x" * 1001) | st.lists(TEXT, min_size=5, max_size=6),
    ),
    "logit_bias": (
        st.dictionaries(_TOKEN.map(str), st.floats(-100, 100), max_size=4),
        JSON
        | st.dictionaries(_BAD_TOKEN.map(str) | TEXT, st.floats(-100, 100), min_size=1, max_size=2)
        | st.dictionaries(_TOKEN.map(str), _number(-100, 100)[1], min_size=1, max_size=2),
    ),
    "stream": _flag(),
    "stream_options": (
        st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
        _broken({"include_usage": _flag()}),
    ),
    "ignore_eos": _flag(),
    # llama-server's name for max_tokens (-1: no limit).
    "n_predict": (st.integers(1, 4), _BAD_COUNT | st.just(0)),
}

_CALL: dict[str, Field] = {
    "id": (TEXT, JSON),
    "type": (st.just("function"), JSON),
    "function": (
        st.fixed_dictionaries(
            {"name": st.sampled_from(_NAMES)},
            optional={"arguments": TEXT | st.dictionaries(TEXT, JSON, max_size=2)},
        ),
        _broken({"name": (st.sampled_from(_NAMES), JSON), "arguments": (TEXT, JSON)}, ("name",)),
    ),
}
_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
_MESSAGE: dict[str, Field] = {
    "role": (st.sampled_from(["system", "user", "assistant", "tool"]), JSON | st.just(ABSENT)),
    "content": (TEXT | st.none() | st.lists(_PART, max_size=2), JSON | st.lists(JSON, max_size=2)),
    "tool_calls": (
        st.lists(_whole(_CALL, ("function",)), max_size=2),
        JSON | st.lists(_broken(_CALL, ("function",)), min_size=1, max_size=2),
    ),
    "tool_call_id": (TEXT, JSON),
    "name": (TEXT, JSON),
}
_MESSAGES = st.lists(_whole(_MESSAGE, ("role", "content")), min_size=1, max_size=3)
_TOOL: dict[str, Field] = {
    "type": (st.just("function"), JSON),
    "function": (
        st.builds(
            lambda name, schema: {"name": name, "parameters": schema},
            st.sampled_from(_NAMES),
            SCHEMA[0],
        ),
        _broken({"name": (st.sampled_from(_NAMES), JSON), "parameters": SCHEMA}, ("name",)),
    ),
}
_TOOLS = st.lists(
    _whole(_TOOL, ("type", "function")), max_size=2, unique_by=lambda t: t["function"]["name"]
)

CHAT_FIELDS: dict[str, Field] = {
    **SAMPLING,
    "messages": (
        _MESSAGES,
        JSON | st.lists(_broken(_MESSAGE, ("role", "content")), min_size=1, max_size=3),
    ),
    "logprobs": _flag(),
    "top_logprobs": (st.integers(0, 20), JSON),
    "tools": (_TOOLS, JSON | st.lists(_broken(_TOOL, ("type", "function")), min_size=1)),
    "tool_choice": (
        st.sampled_from(["auto", "none", "required"])
        | st.builds(
            lambda name: {"type": "function", "function": {"name": name}}, st.sampled_from(_NAMES)
        ),
        JSON,
    ),
    "parallel_tool_calls": _flag(),
    "response_format": (
        st.sampled_from([{"type": "text"}, {"type": "json_object"}])
        | st.builds(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}, SCHEMA[0]),
        JSON
        | st.builds(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}, SCHEMA[1]),
    ),
    # llama-server's own constraints on a chat.
    "json_schema": SCHEMA,
    "grammar": (
        st.sampled_from(['root ::= "a" | "b"', "root ::= [0-9]+"]),
        JSON | st.sampled_from(["", "root ::= missing", "root ::= (", "::="]),
    ),
}
COMPLETION_FIELDS: dict[str, Field] = {
    **SAMPLING,
    "prompt": (
        st.text(min_size=1, max_size=20) | st.lists(_TOKEN, min_size=1, max_size=8),
        JSON | st.lists(_BAD_TOKEN, min_size=1, max_size=2) | st.lists(JSON, max_size=3),
    ),
    "logprobs": (st.integers(0, 20), JSON),
    "echo": _flag(),
}


def _named_tools(make: Any) -> Field:
    """A list of tools, each ``make(name, schema)`` (a top-level ``name``,
    as the Responses and Anthropic APIs have them), and junk."""
    tool = st.builds(make, st.sampled_from(_NAMES), SCHEMA[0])
    return (
        st.lists(tool, max_size=2, unique_by=lambda t: t["name"]),
        JSON | st.lists(JSON, min_size=1, max_size=2),
    )


_ITEM: dict[str, Field] = {
    "type": (
        st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
        JSON,
    ),
    "role": (st.sampled_from(["user", "assistant", "system", "developer"]), JSON),
    "content": (
        TEXT | st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": TEXT})),
        JSON | st.lists(JSON, min_size=1, max_size=2),
    ),
    "call_id": (TEXT, JSON),
    "name": (st.sampled_from(_NAMES), JSON),
    "arguments": (TEXT, JSON),
    "output": (TEXT, JSON),
}
RESPONSES_FIELDS: dict[str, Field] = {
    "model": (TEXT, JSON),
    "input": (
        st.text(min_size=1, max_size=12)
        | st.lists(_whole(_ITEM, ("role", "content")), min_size=1, max_size=3),
        JSON | st.lists(_broken(_ITEM), min_size=1, max_size=3),
    ),
    "instructions": (TEXT, JSON),
    "max_output_tokens": (st.integers(1, 4), _BAD_COUNT),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1),
    "stream": _flag(),
    "store": _flag(),
    "tools": _named_tools(
        lambda name, schema: {"type": "function", "name": name, "parameters": schema}
    ),
    "tool_choice": (
        st.sampled_from(["auto", "none"])
        | st.builds(lambda name: {"type": "function", "name": name}, st.sampled_from(_NAMES)),
        JSON,
    ),
    "text": (
        st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])
        | st.builds(lambda s: {"format": {"type": "json_schema", "schema": s}}, SCHEMA[0]),
        JSON | st.builds(lambda s: {"format": {"type": "json_schema", "schema": s}}, SCHEMA[1]),
    ),
    "reasoning": (
        st.fixed_dictionaries({"effort": st.sampled_from(["minimal", "low", "medium", "high"])}),
        JSON,
    ),
    "previous_response_id": (st.just("resp_none"), JSON),
}


OLLAMA_FIELDS: dict[str, Field] = {
    "model": (TEXT, JSON),
    "messages": CHAT_FIELDS["messages"],
    "tools": CHAT_FIELDS["tools"],
    "format": (
        st.sampled_from(["json", ""]) | SCHEMA[0],
        st.sampled_from(["xml", 5]) | SCHEMA[1],
    ),
    "options": (
        st.fixed_dictionaries(
            {"num_predict": st.integers(1, 4)},
            optional={
                "temperature": st.floats(0, 2),
                "top_k": st.integers(0, 100),
                "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
                "num_ctx": st.integers(1, 9999),
            },
        ),
        JSON | st.fixed_dictionaries({"num_predict": _BAD_COUNT}),
    ),
    "stream": _flag(),
    "think": (st.booleans() | st.sampled_from(["low", "high"]), JSON),
    "keep_alive": (st.sampled_from(["5m", 30, "1h", -1]), JSON | st.just("soon")),
}


_BLOCK: dict[str, Field] = {
    "type": (
        st.sampled_from(["text", "image", "tool_use", "tool_result", "document", "thinking"]),
        JSON,
    ),
    "text": (TEXT, JSON),
    "id": (TEXT, JSON),
    "name": (st.sampled_from(_NAMES), JSON),
    "input": (st.dictionaries(TEXT, JSON, max_size=2), JSON),
    "tool_use_id": (TEXT, JSON),
    "content": (TEXT, JSON),
    "thinking": (TEXT, JSON),
    "source": (
        st.fixed_dictionaries({"type": st.just("text"), "data": TEXT, "media_type": TEXT}),
        JSON,
    ),
}
_ANTHROPIC_MESSAGE: dict[str, Field] = {
    "role": (st.sampled_from(["user", "assistant"]), JSON | st.just(ABSENT)),
    "content": (
        TEXT | st.lists(_whole(_BLOCK, ("type",)), max_size=2),
        JSON | st.lists(_broken(_BLOCK, ("type",)), min_size=1, max_size=2),
    ),
}
ANTHROPIC_FIELDS: dict[str, Field] = {
    "model": (TEXT, JSON),
    "max_tokens": (st.integers(1, 4), _BAD_COUNT),
    "messages": (
        st.lists(_whole(_ANTHROPIC_MESSAGE, ("role", "content")), min_size=1, max_size=3),
        JSON | st.lists(_broken(_ANTHROPIC_MESSAGE, ("role", "content")), min_size=1, max_size=3),
    ),
    "system": (
        TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        JSON,
    ),
    "temperature": _number(0, 1),
    "top_p": _number(0, 1),
    "top_k": (st.integers(0, 100), JSON),
    "stop_sequences": (
        st.lists(st.text(min_size=1, max_size=4), max_size=4),
        JSON | st.lists(TEXT, min_size=65, max_size=66),
    ),
    "stream": _flag(),
    "tools": _named_tools(lambda name, schema: {"name": name, "input_schema": schema}),
    "tool_choice": (
        st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
        | st.builds(lambda name: {"type": "tool", "name": name}, st.sampled_from(_NAMES)),
        JSON,
    ),
    "thinking": (
        st.sampled_from([{"type": "disabled"}])
        | st.builds(lambda n: {"type": "enabled", "budget_tokens": n}, st.integers(1, 4)),
        JSON,
    ),
    "output_config": (
        st.builds(lambda s: {"format": {"type": "json_schema", "schema": s}}, SCHEMA[0]),
        JSON | st.builds(lambda s: {"format": {"type": "json_schema", "schema": s}}, SCHEMA[1]),
    ),
    "metadata": (st.fixed_dictionaries({}, optional={"user_id": TEXT}), JSON),
}
LLAMA_FIELDS: dict[str, Field] = {
    **SAMPLING,
    "prompt": COMPLETION_FIELDS["prompt"],
    "grammar": CHAT_FIELDS["grammar"],
    "json_schema": SCHEMA,
}


def anthropic_requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """``(path, body)`` for Anthropic's ``/v1/messages``."""
    body = _record(ANTHROPIC_FIELDS, ("messages", "max_tokens"))
    return st.tuples(st.just(MESSAGES), body.map(_dumps) | ODD_BODIES)


def llama_requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """``(path, body)`` for llama-server's ``/completion``."""
    body = _record(LLAMA_FIELDS, ("prompt", "n_predict"))
    return st.tuples(st.just(LLAMA_COMPLETION), body.map(_dumps) | ODD_BODIES)


def every_surface() -> st.SearchStrategy[tuple[str, bytes]]:
    """Requests of every API the server speaks (bench/fuzz_server.py)."""
    return st.one_of(
        requests(),
        responses_requests(),
        ollama_requests(),
        anthropic_requests(),
        llama_requests(),
    )


def ollama_requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """``(path, body)`` for Ollama's ``/api/chat`` (bounded by
    ``options.num_predict``)."""
    body = _record(OLLAMA_FIELDS, ("messages", "options"))
    return st.tuples(st.just(OLLAMA_CHAT), body.map(_dumps) | ODD_BODIES)


def responses_requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """``(path, body)`` for ``/v1/responses``."""
    body = _record(RESPONSES_FIELDS, ("input", "max_output_tokens"))
    return st.tuples(st.just(RESPONSES), body.map(_dumps) | ODD_BODIES)


def _dumps(body: object) -> bytes:
    return json.dumps(body).encode()


def _nested(depth: int, inside: bytes = b"") -> bytes:
    return b"[" * depth + inside + b"]" * depth


# Not an object, not JSON, not UTF-8, or nested past every parser's depth.
ODD_BODIES = (
    st.binary(max_size=16)
    | JSON.map(_dumps)
    | st.integers(100, 200_000).map(_nested)
    | st.integers(100, 5_000).map(lambda d: b'{"messages": ' + _nested(d) + b"}")
)


def requests() -> st.SearchStrategy[tuple[str, bytes]]:
    """``(path, body)`` for both completion endpoints."""
    chat = _record(CHAT_FIELDS, ("messages", "max_tokens"))
    completion = _record(COMPLETION_FIELDS, ("prompt", "max_tokens"))
    return st.one_of(
        st.tuples(st.just(CHAT), chat.map(_dumps)),
        st.tuples(st.just(COMPLETIONS), completion.map(_dumps)),
        st.tuples(st.sampled_from([CHAT, COMPLETIONS]), ODD_BODIES),
    )


# -- the contract ------------------------------------------------------------------


def check(r: httpx.Response) -> None:
    """A success with a well-formed body, or a 4xx with OpenAI's error body."""
    ollama = r.request.url.path == OLLAMA_CHAT
    if 400 <= r.status_code < 500:
        error = r.json()["error"]
        if ollama:  # Ollama's body: {"error": "..."}
            assert isinstance(error, str)
            assert error
            return
        assert isinstance(error["message"], str)
        assert error["message"]
        assert isinstance(error["type"], str)
        return
    assert r.status_code == 200, f"{r.status_code}: {r.text[:2000]}"
    path = r.request.url.path
    if path in (MESSAGES, LLAMA_COMPLETION):
        _check_other(r, path)
        return
    responses = r.request.url.path == RESPONSES
    if ollama:
        lines = [json.loads(x) for x in r.text.splitlines() if x.strip()]
        assert lines[-1]["done"] is True, r.text[-2000:]
        assert all("error" not in x for x in lines), r.text[-2000:]
        return
    if not r.headers["content-type"].startswith("text/event-stream"):
        assert r.json()["output" if responses else "choices"]
        return
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if responses:
        last = json.loads(events[-1])
        assert last["type"] in ("response.completed", "response.incomplete"), r.text[-2000:]
        return
    assert events[-1] == "[DONE]", r.text[-2000:]
    for event in events[:-1]:
        assert "error" not in json.loads(event), event


class Fuzzer:
    """Sends requests to the server at ``url``, each followed by a good one
    that must succeed, after which every lease must be back; counts the
    responses to the fuzzed ones by status."""

    def __init__(self, url: str, n_seq_max: int) -> None:
        self.url = url
        self.n_seq_max = n_seq_max
        self.client = httpx.Client(base_url=url, timeout=HANG_GUARD_S)
        self.counts: Counter[int] = Counter()

    def __enter__(self) -> Fuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def round(self, request: tuple[str, bytes]) -> None:
        path, body = request
        r = self.client.post(path, content=body, headers={"content-type": "application/json"})
        self.counts[r.status_code] += 1
        check(r)
        good = self.client.post(path, json=GOOD[path])
        assert good.status_code == 200, f"the good request after this one: {good.text}"
        leases_back(self.url, self.n_seq_max)


def _check_other(r: httpx.Response, path: str) -> None:
    """A success of Anthropic's API or llama-server's ``/completion``."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        body = r.json()
        if path == MESSAGES:
            assert body["type"] == "message", r.text[:2000]
            assert isinstance(body["content"], list), r.text[:2000]
        else:
            assert isinstance(body["content"], str), r.text[:2000]
        return
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    last = events[-1]
    if path == MESSAGES:
        assert last["type"] == "message_stop", r.text[-2000:]
    else:
        assert last["stop"] is True, r.text[-2000:]
