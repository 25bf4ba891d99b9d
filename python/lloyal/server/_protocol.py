"""The requests lloyal serves, checked into plain data: the internal
request types, OpenAI's bodies, and the checks every API's parser shares.

Anything malformed is an :class:`ApiError` with status 400 and the name of
the offending field, before any work starts: every value that reaches the
engine (token ids, biases, stop strings, messages, tools, schemas) is one
it accepts, so no request can fail inside the step loop the requests share.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lloyal.chat.format import check_messages, check_tools
from lloyal.sampling import SamplingParams

__all__ = [
    "ApiError",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "RequestOptions",
    "parse_json",
]

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_CHARS = 1000
"""Per stop string: held-back text is matched against every prefix of each
stop string at every token, so its length bounds the work per token."""
MAX_DEPTH = 128
"""Nesting of a request body: serde_json's limit, which the chat template
and grammar parsers apply to what they are given anyway."""


class ApiError(Exception):
    """An error the client gets as OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class RequestOptions:
    """What both completion endpoints share. (``model`` is checked to be
    a string and otherwise ignored: the server has one model.)"""

    n: int
    max_tokens: int | None
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None  # top-k alternatives per token; None: no logprobs
    ignore_eos: bool = False  # llama-server's extension: generate max_tokens tokens
    # llama-server's extension: (adapter id, scale) pairs; None: the default set.
    lora: tuple[tuple[int, float], ...] | None = None
    # Tokens of reasoning before the end-of-thinking marker is forced; None:
    # the server's --reasoning-budget.
    reasoning_budget: int | None = None
    # Most drafted tokens a speculative round may verify; None: the
    # server's --spec-k; 0: no speculation for this request.
    speculative: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    generation: RequestOptions
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    json_schema: Mapping[str, Any] | bool | None = None
    # llama-server's GBNF ``grammar`` for the whole reply (not with tools
    # or a JSON schema).
    grammar: str | None = None
    reasoning_effort: str | None = None  # a template variable (GPT-OSS reads it)
    enable_thinking: bool | None = None  # a template variable (Qwen 3 reads it)
    # llama-server's: "none" leaves the reasoning in the content, with its
    # markers; "auto" / "deepseek" split it out; None: the server's.
    reasoning_format: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | list[int], ...]
    generation: RequestOptions
    echo: bool = False
    # Text after the cursor: each prompt is the text before it, and the
    # reply fills the middle (models with FIM tokens only).
    suffix: str | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    inputs: list[str] | list[list[int]]
    base64: bool = False
    dimensions: int | None = None


def parse_json(raw: bytes) -> object:
    """A request body's JSON: nested at most ``MAX_DEPTH`` deep, its text
    all Unicode (JSON lets ``"\\ud800"`` through; no tokenizer, template or
    grammar takes it)."""
    deep = ApiError(f"the request body is nested more than {MAX_DEPTH} levels deep")
    try:
        body: object = json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one too
        raise ApiError("the request body is not valid JSON") from None
    except RecursionError:
        raise deep from None
    level = [body]
    for depth in range(MAX_DEPTH + 1):
        inner: list[object] = []
        for value in level:
            if isinstance(value, str):
                _unicode(value)
            elif isinstance(value, dict):
                for key in value:
                    _unicode(key)
                inner.extend(value.values())
            elif isinstance(value, list):
                inner.extend(value)
            else:
                continue
            if depth == MAX_DEPTH:
                raise deep
        level = inner
    return body


def _unicode(text: str) -> None:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ApiError(
                "the request body has text that is not Unicode (a lone surrogate)"
            ) from None


def json_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not _finite(value):
        raise ApiError(f"{name} must be a number", param=name)
    if not lo <= value <= hi:
        raise ApiError(f"{name} must be between {lo} and {hi}", param=name)
    return float(value)


def _finite(value: object) -> bool:
    """A JSON number that is not NaN or infinite (JSON integers of any size
    are Python ints, which ``math.isfinite`` cannot convert)."""
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def integer_field(
    body: dict[str, Any], name: str, default: int | None, lo: int, hi: int
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise ApiError(f"{name} must be between {lo} and {hi}", param=name)
    return value


def flag_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", param=name)
    return value


MAX_LORAS = 64


def lora_field(value: object, *, param: str = "lora") -> tuple[tuple[int, float], ...] | None:
    """llama-server's ``lora``: a list of ``{"id": int, "scale": number}``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        raise ApiError(f"{param} must be a list of at most {MAX_LORAS} objects", param=param)
    pairs: list[tuple[int, float]] = []
    for item in value:
        if not isinstance(item, dict) or set(item) - {"id", "scale"}:
            raise ApiError(
                f'each {param} entry must be {{"id": int, "scale": number}}', param=param
            )
        try:
            i = integer_field(item, "id", None, 0, MAX_LORAS - 1)
            scale = _number(item, "scale", 1.0, -100.0, 100.0)
        except ApiError as e:
            raise ApiError(f"{param}: {e}", param=param) from None
        if i is None:
            raise ApiError(f"each {param} entry needs an id", param=param)
        if any(i == j for j, _ in pairs):
            raise ApiError(f"lora id {i} is given twice", param=param)
        pairs.append((i, scale))
    return tuple(pairs)


def stop_strings(value: object, param: str = "stop", *, most: int = 4) -> tuple[str, ...]:
    """Stop strings: one string or a list of at most ``most`` (OpenAI's 4),
    none empty."""
    if value is None:
        stops: tuple[str, ...] = ()
    elif isinstance(value, str):
        stops = (value,)
    elif isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= most:
        stops = tuple(value)
    else:
        raise ApiError(f"{param} must be a string or a list of at most {most} strings", param=param)
    if any(not s for s in stops):
        raise ApiError(f"{param} strings must not be empty", param=param)
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(f"{param} strings may have at most {MAX_STOP_CHARS} characters", param=param)
    return stops


def sampling(body: dict[str, Any], vocab_size: int) -> tuple[SamplingParams, int | None]:
    """The sampling fields of a body, and its seed (both APIs name them
    alike): OpenAI's, plus llama-server's top_k and min_p with its
    defaults (40 and 0.05): a full-vocabulary sort per token would cost
    milliseconds on a 262k vocabulary."""
    pairs = _logit_bias(body.get("logit_bias"), vocab_size)
    seed = integer_field(body, "seed", None, -(2**63), 2**64 - 1)
    seed = None if seed is None else seed % 2**32
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=integer_field(body, "top_k", 40, 0, 1 << 20) or 0,
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        seed=seed,
        logit_bias=pairs,
    )
    return params, seed


def _generation(body: dict[str, Any], *, logprobs: int | None, vocab_size: int) -> RequestOptions:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("model must be a string", param="model")
    stops = stop_strings(body.get("stop"))
    params, seed = sampling(body, vocab_size)
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError("stream_options.include_usage must be true or false", param="stream_options")
    max_tokens = integer_field(body, "max_completion_tokens", None, 1, 1 << 20)
    if max_tokens is None:
        max_tokens = integer_field(body, "max_tokens", None, 1, 1 << 20)
    if max_tokens is None:  # llama-server's name; -1: no limit
        max_tokens = integer_field(body, "n_predict", None, -1, 1 << 20)
        if max_tokens == 0:
            raise ApiError("n_predict must be -1 (no limit) or at least 1", param="n_predict")
        if max_tokens == -1:
            max_tokens = None
    return RequestOptions(
        n=integer_field(body, "n", 1, 1, MAX_N) or 1,
        max_tokens=max_tokens,
        params=params,
        seed=seed,
        stop=stops,
        stream=flag_field(body, "stream", False),
        include_usage=bool(include_usage),
        logprobs=logprobs,
        ignore_eos=flag_field(body, "ignore_eos", False),
        lora=lora_field(body.get("lora")),
        reasoning_budget=integer_field(body, "reasoning_budget", None, -1, 1 << 20),
        speculative=_speculative(body),
    )


MAX_DRAFT = 32


def _speculative(body: dict[str, Any]) -> int | None:
    """llama-server's ``speculative.n_max`` (drafts per round; 0: none),
    or ``"speculative": false`` to opt out."""
    if body.get("speculative") is False:
        return 0
    if body.get("speculative") not in (None, True):
        raise ApiError("speculative must be true or false", param="speculative")
    return integer_field(body, "speculative.n_max", None, 0, MAX_DRAFT)


def _logit_bias(bias: object, vocab_size: int) -> list[tuple[int, float]]:
    """``{"token id": bias}``: ids of this vocabulary, biases in [-100, 100]."""
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise ApiError("logit_bias must map token ids to biases", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        # ASCII digits only: int() would also take "+1", " 1", "1_0" and other scripts' digits.
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12
        if not digits or int(key) >= vocab_size:
            raise ApiError(
                f"logit_bias key {str(key)[:20]!r} is not a token id in [0, {vocab_size})",
                param="logit_bias",
            )
        if isinstance(value, bool) or not _finite(value) or not -100 <= value <= 100:
            raise ApiError("logit_bias values must be numbers in [-100, 100]", param="logit_bias")
        pairs.append((int(key), float(value)))
    return pairs


def tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """A checked ``tool_choice`` for the chat layer (``"auto"`` when None)."""
    if choice is None:
        return "auto"
    named = isinstance(choice, dict) and isinstance(choice.get("function"), dict)
    if choice not in ("auto", "none", "required") and not (
        named and isinstance(choice["function"].get("name"), str)
    ):
        raise ApiError(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice != "auto" and choice != "none" and not tools:
        raise ApiError(
            f"tool_choice {choice!r} needs tools: this request has none", param="tool_choice"
        )
    try:
        check_tools(tools, choice)
    except ValueError as e:
        raise ApiError(str(e), param="tool_choice") from None
    return choice


def _parts(content: list[Any], where: str) -> str | list[dict[str, Any]]:
    """OpenAI content parts: text alone becomes a string; ``image_url``
    (a ``data:`` URL: the server fetches nothing) and ``input_audio`` stay
    parts, for ``format_chat`` to place."""
    if not all(isinstance(p, dict) for p in content):
        raise ApiError(f"{where}: content parts must be objects", param="messages")
    for j, p in enumerate(content):
        kind = p.get("type")
        if kind == "text" and isinstance(p.get("text"), str):
            continue
        if kind == "image_url":
            spec = p.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else None
            if not isinstance(url, str) or not url.startswith("data:"):
                raise ApiError(
                    f"{where}[{j}].image_url.url must be a data: URL (remote images are "
                    "not fetched)",
                    param="messages",
                )
            continue
        if kind == "input_audio":
            spec = p.get("input_audio")
            if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
                raise ApiError(f"{where}[{j}].input_audio needs base64 data", param="messages")
            continue
        raise ApiError(
            f"{where}[{j}]: parts are text, image_url or input_audio, got {kind!r}",
            param="messages",
        )
    if all(p["type"] == "text" for p in content):
        return "".join(p["text"] for p in content)
    return [dict(p) for p in content]


def checked_messages(messages: object) -> list[dict[str, Any]]:
    """Chat messages in the chat layer's form (``role``, ``content`` as a
    string or parts, ``tool_calls``...), checked (400 naming the message)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a role", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text, images, audio
            messages[i] = {**m, "content": _parts(content, f"messages[{i}].content")}
        elif content is not None and not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string", param="messages")
    try:
        check_messages(messages)
    except ValueError as e:
        raise ApiError(str(e), param="messages") from None
    return messages


def checked_tools(tools: object) -> list[dict[str, Any]] | None:
    """Function tools in the chat layer's form, checked; None for none."""
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError("tools must be a list of objects", param="tools")
    try:
        check_tools(tools, "auto")
    except (TypeError, ValueError) as e:
        raise ApiError(str(e), param="tools") from None
    return tools or None


def chat_request(raw: object, *, vocab_size: int) -> ChatRequest:
    """An OpenAI chat completion request."""
    body = json_object(raw)
    messages = checked_messages(body.get("messages"))
    top: int | None = None
    if flag_field(body, "logprobs", False):
        top = integer_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    tools = checked_tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools)
    schema: Mapping[str, Any] | bool | None = None
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise ApiError(
                "response_format.type must be text, json_object or json_schema",
                param="response_format",
            )
        if fmt["type"] == "json_object":
            schema = {"type": "object"}
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ApiError(
                    "response_format.json_schema.schema must be a JSON schema",
                    param="response_format",
                )
            schema = spec.get("schema", {"type": "object"})
    # llama-server's own fields for the same: a schema, or a GBNF grammar.
    if body.get("json_schema") is not None:
        if schema is not None:
            raise ApiError("give json_schema or response_format, not both", param="json_schema")
        if not isinstance(body["json_schema"], (dict, bool)):
            raise ApiError("json_schema must be a JSON schema", param="json_schema")
        schema = body["json_schema"]
    grammar = body.get("grammar")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ApiError("grammar must be a GBNF grammar (a string)", param="grammar")
        if schema is not None or (tools and choice != "none"):
            raise ApiError(
                "grammar constrains the whole reply: not with tools, json_schema or "
                "response_format",
                param="grammar",
            )
    return ChatRequest(
        messages=messages,
        generation=_generation(body, logprobs=top, vocab_size=vocab_size),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=flag_field(body, "parallel_tool_calls", True),
        json_schema=schema,
        grammar=grammar,
        reasoning_effort=_effort(body.get("reasoning_effort")),
        reasoning_format=reasoning_format(body.get("reasoning_format")),
    )


REASONING_FORMATS = ("auto", "deepseek", "none")


def reasoning_format(value: object) -> str | None:
    """A ``reasoning_format``: ``auto`` / ``deepseek`` (the reasoning in
    ``reasoning_content``) or ``none`` (left in the content)."""
    if value is None:
        return None
    if value not in REASONING_FORMATS:
        raise ApiError(
            f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}",
            param="reasoning_format",
        )
    return str(value)


def _effort(value: object) -> str | None:
    if value is None:
        return None
    if value not in ("minimal", "low", "medium", "high"):
        raise ApiError(
            "reasoning_effort must be minimal, low, medium or high", param="reasoning_effort"
        )
    return str(value)


MAX_PROMPTS = 64


def completion_request(raw: object, *, vocab_size: int) -> CompletionRequest:
    body = json_object(raw)
    prompt = body.get("prompt")
    # One prompt (text or token ids) or several (a list of either):
    # langchain's batch sends several.
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts: list[Any] = prompt
    else:
        prompts = [prompt]
    if not 0 < len(prompts) <= MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
    checked: list[str | list[int]] = []
    for p in prompts:
        if (
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            if any(not 0 <= t < vocab_size for t in p):
                raise ApiError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
            checked.append(list(p))
        elif isinstance(p, str) and p:
            checked.append(p)
        else:
            raise ApiError(
                "prompt must be a non-empty string, a list of token ids, or a list of those",
                param="prompt",
            )
    if len(checked) > 1 and flag_field(body, "stream", False):
        raise ApiError("a streamed request takes one prompt", param="prompt")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise ApiError("suffix must be a string", param="suffix")
    if suffix and not all(isinstance(p, str) for p in checked):
        raise ApiError("a suffix goes with text prompts, not token ids", param="suffix")
    top = integer_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    generation = _generation(body, logprobs=top, vocab_size=vocab_size)
    return CompletionRequest(
        prompts=tuple(checked),
        generation=generation,
        echo=flag_field(body, "echo", False),
        suffix=suffix or None,
    )
