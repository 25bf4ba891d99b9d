"""Tool calls and structured replies for :meth:`Context.format_chat`.

A chat template either knows how to show tools to its model (its source
mentions ``tools``) or it does not. When it does, the tools go to the
template as the ``tools`` variable and the model is expected to answer in
its family's tool-call syntax; the family is recognised from markers in the
template source:

========== ============================================ ===================
family     recognised by                                a call looks like
========== ============================================ ===================
hermes     ``<tool_call>`` (Hermes 2 Pro, Qwen 2.5/3)   ``<tool_call>{json}</tool_call>``
llama3     ``<|python_tag|>`` or Llama 3 headers        ``{"name": ..., "parameters": ...}``
mistral    ``[TOOL_CALLS]``                             ``[TOOL_CALLS][{json}, ...]``
deepseek   DeepSeek's tool-calls-begin marker           DeepSeek's tagged blocks
qwen3-coder ``<function=`` / ``<parameter=``            a tag per parameter
glm-4.5    ``<arg_key>``                                key and value tags
kimi-k2    ``<|tool_calls_section_begin|>``             indexed calls, JSON
granite    ``<|tool_call|>``                            a JSON list of calls
command-r  ``<|START_ACTION|>``                         a JSON list of actions
gpt-oss    ``<|channel|>`` (harmony)                    ``to=functions.NAME``
========== ============================================ ===================

Qwen3 writes hermes calls; a template's own reasoning switch
(``enable_thinking=``) and effort (GPT-OSS's ``reasoning_effort="high"``)
are template variables: extra keyword arguments of ``format_chat`` reach
the template as they are.

A template that does not mention tools (SmolLM2's, the built-in ``gemma``
and ``chatml`` ones) gets the tools described in its system message with
the hermes convention, and earlier tool calls and results in ``messages``
are rewritten into text the template can show (results become a user turn
in ``<tool_response>`` tags).

The returned grammar is Lark text with inline JSON schemas: with
``tool_choice="auto"`` it is *lazy* (it waits for the family's opener, then
forces a call whose name and arguments match one tool's schema); with
``"required"`` or a named function it constrains from the first token.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lloyal.chat._families import FAMILIES, family, inline_json, tool_grammar
from lloyal.chat._markers import (
    THINK,
    THINKING,
)

__all__ = ["ToolSpec", "check_messages", "check_tools", "prepare_chat"]


@dataclass(frozen=True)
class ToolSpec:
    """What :func:`prepare_chat` decided: the messages and template
    variables to render, and the grammar that goes with the prompt."""

    messages: list[dict[str, Any]]
    variables: dict[str, Any]
    chat_format: str
    grammar: str | None
    triggers: tuple[str, ...]
    markers: tuple[str, ...]
    # What opens and closes the family's reasoning (``<think>`` mostly).
    think: tuple[str, str] = THINKING


# An inlined schema of more nodes than this is refused (a chain of
# references can multiply a schema's size).
_MAX_NODES = 100_000


def inline_refs(schema: Mapping[str, Any], what: str = "the schema") -> dict[str, Any]:
    """``schema`` with its local references (``#/$defs/...``,
    ``#/definitions/...``, ``#``) replaced by what they point at, and its
    definitions dropped: a tool's parameters are placed inside a call's
    schema (or one argument at a time), where a reference to the tool's own
    root would point elsewhere (pydantic writes nested models this way). A
    reference back into itself (a recursive model) becomes any value, one
    level down. Raises ``ValueError`` for a reference to nothing.

    >>> inline_refs({"$defs": {"A": {"type": "integer"}},
    ...              "properties": {"a": {"$ref": "#/$defs/A"}}})
    {'properties': {'a': {'type': 'integer'}}}
    """

    def resolve(ref: str) -> Any:
        node: Any = schema
        for part in ref[2:].split("/") if ref != "#" else ():
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise ValueError(f"{what}: $ref {ref!r} points at nothing")
        return node

    budget = [_MAX_NODES]

    def walk(node: Any, seen: frozenset[str]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"{what}: the schema with its references inlined is too large")
        if isinstance(node, list):
            return [walk(x, seen) for x in node]
        if not isinstance(node, Mapping):
            return node
        ref = node.get("$ref")
        rest = {k: walk(v, seen) for k, v in node.items() if k != "$ref"}
        if not (isinstance(ref, str) and ref.startswith("#")):
            return rest
        if ref in seen:
            return rest  # recursion: any value here
        target = walk(resolve(ref), seen | {ref})
        if not isinstance(target, Mapping):
            return rest
        inlined = {k: v for k, v in target.items() if k not in ("$defs", "definitions")}
        return {**inlined, **rest}

    top = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return dict(walk(top, frozenset()))


# Where a JSON schema holds schemas: maps of them, lists of them, one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says
    nothing of other keys closed (``additionalProperties: false``), as
    llama.cpp's converter (and so llama-server) reads tool parameters and
    response formats. JSON Schema's default would let a model add keys of
    its own until ``max_tokens`` cuts the call, and most clients leave the
    keyword out. An object that opens itself (``additionalProperties``,
    ``patternProperties``, ``unevaluatedProperties``) or lists no
    properties is left as it is.

    >>> closed_objects({"type": "object", "properties": {"a": {"type": "object",
    ...     "properties": {"b": {}}}}, "additionalProperties": True})
    {'type': 'object', 'properties': {'a': {'type': 'object', 'properties': {'b': {}}, \
'additionalProperties': False}}, 'additionalProperties': True}
    """
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(v) for name, v in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(v) for v in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), list):  # draft 4 tuple items
            out[key] = [closed_objects(v) for v in out[key]]
        elif key in out:
            out[key] = closed_objects(out[key])
    opened = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), Mapping) and not any(k in out for k in opened):
        out["additionalProperties"] = False
    return out


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``function`` objects of OpenAI-style tools (bare function objects
    are accepted too), checked enough to build a grammar from."""
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TypeError(f"each tool is a dict, got {type(tool).__name__}")
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(
                'each tool needs {"type": "function", "function": {"name": ..., "parameters": ...}}'
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, Mapping):
            raise ValueError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
        out.append({**fn, "parameters": inline_refs(params, f"tool {fn['name']!r}")})
    names = [f["name"] for f in out]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return out


def check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise for the first message :meth:`Context.format_chat` cannot
    render: ``TypeError`` for one that is not a dict, ``ValueError``
    naming the message and field for a malformed one (a role that is not
    a string; content that is not a string, ``None`` or a list of content
    parts; ``tool_calls`` that are not a list of calls, each with a
    function name and string or object arguments; a ``name`` or
    ``tool_call_id`` that is not a string).

    >>> check_messages([{"role": "assistant", "tool_calls": "get_weather"}])
    Traceback (most recent call last):
    ...
    ValueError: messages[0].tool_calls must be a list of calls, got str
    """
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise TypeError(f"{at} must be a dict with a role, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{at} needs a 'role' that is a string")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, Mapping) for part in content):
                raise ValueError(f"{at}.content: each content part must be an object")
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"{at}.content must be a string, null or a list of content parts, "
                f"got {type(content).__name__}"
            )
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ValueError(f"{at}.{key} must be a string")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise ValueError(f"{at}.tool_calls must be a list of calls, got {type(calls).__name__}")
        for j, call in enumerate(calls):
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    f"{at}.tool_calls[{j}] must be an object with a function name "
                    '({"function": {"name": ..., "arguments": ...}})'
                )
            if not isinstance(fn.get("arguments", {}), (str, Mapping)):
                raise ValueError(f"{at}.tool_calls[{j}] arguments must be a JSON string or object")


def check_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any) -> None:
    """Raise what :meth:`Context.format_chat` would for ``tools`` and
    ``tool_choice``: ``TypeError`` for a tool that is not a dict,
    ``ValueError`` for a malformed tool or a ``tool_choice`` that is not
    ``"auto"``, ``"none"``, ``"required"`` or one of the tools.

    >>> check_tools([], "sometimes")
    Traceback (most recent call last):
    ...
    ValueError: tool_choice must be 'auto', 'none', 'required' or a function, got 'sometimes'
    """
    functions = _functions(tools) if tools else []
    if tool_choice != "none":
        _chosen(functions, tool_choice)


def _chosen(functions: list[dict[str, Any]], tool_choice: Any) -> tuple[list[dict[str, Any]], bool]:
    """The functions a call may name, and whether a call is required."""
    if tool_choice in ("auto", None):
        return functions, False
    if tool_choice == "required":
        return functions, True
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function", tool_choice)
        name = fn.get("name") if isinstance(fn, Mapping) else None
        picked = [f for f in functions if f["name"] == name]
        if not picked:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return picked, True
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'required' or a function, got {tool_choice!r}"
    )


def _system_text(functions: list[dict[str, Any]], parallel: bool) -> str:
    """Describe the tools to a model whose template cannot (hermes style)."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    many = " You may make several calls, one block each." if parallel else ""
    return (
        "You can call the functions described below, one JSON object per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call one, answer with its name and arguments as JSON between "
        "<tool_call> and </tool_call>, for example:\n"
        '<tool_call>\n{"name": "the_function", "arguments": {"argument": "value"}}\n</tool_call>'
        f"{many}"
    )


def _text(content: Any) -> str:
    """A message's content as text: its text parts joined, ``""`` for none."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p.get("text"), str))
    return content or ""


def _as_text(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """Rewrite tool calls and tool results as plain text turns (for
    templates that know nothing of tools), merging consecutive results into
    one user turn so that templates insisting on alternating roles accept
    them."""
    out: list[dict[str, Any]] = []
    results = False  # whether out[-1] is a turn of merged tool results
    for m in messages:
        role = m.get("role")
        content = _text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    # Not JSON (or nested past the parser's depth): kept as text.
                    with contextlib.suppress(ValueError, RecursionError):
                        args = json.loads(args)
                body = json.dumps({"name": fn.get("name"), "arguments": args})
                blocks.append(f"<tool_call>\n{body}\n</tool_call>")
            text = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({**m, "content": content})
    if system is not None:
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def prepare_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool,
    json_schema: Mapping[str, Any] | bool | None,
    enable_thinking: bool | None,
    special_id: Callable[[str], int | None] = lambda marker: None,
) -> ToolSpec:
    """Decide how to render ``messages`` with ``template`` and which grammar
    constrains the reply (see the module docs). ``special_id`` gives a
    marker's id when it is a single special token of the model (the
    grammar then names the token)."""
    check_messages(messages)
    variables: dict[str, Any] = {}
    if enable_thinking is not None:
        variables["enable_thinking"] = bool(enable_thinking)
    native = family(template)
    functions = _functions(tools) if tools else []
    if tool_choice == "none":
        functions = []
    chat_format = native or "hermes"
    opens = FAMILIES[chat_format].parser.think
    think = opens if opens != THINKING or THINK in template else ()
    if not functions:
        grammar = None
        if json_schema is not None:
            grammar = f"start: %json {inline_json(closed_objects(json_schema))}\n"
        rendered = [dict(m) for m in messages] if native else _as_text(messages, None)
        return ToolSpec(
            rendered, variables, chat_format if tools else "content", grammar, (), think, opens
        )
    allowed, required = _chosen(functions, tool_choice)
    ids = {m: special_id(m) for m in FAMILIES[chat_format].markers}
    specials = {m: i for m, i in ids.items() if i is not None}
    closed = [{**f, "parameters": closed_objects(f["parameters"])} for f in allowed]
    grammar, triggers = tool_grammar(chat_format, closed, parallel_tool_calls, specials)
    if json_schema is not None and not required:
        # Tools and a reply format, as OpenAI takes them: the reply is the
        # calls or an answer in the format, from its first token.
        calls = re.sub(r"^start:", "tool_calls_:", grammar, count=1, flags=re.M)
        grammar = f"start: tool_calls_ | %json {inline_json(closed_objects(json_schema))}\n{calls}"
        triggers = ()
    if native:
        variables["tools"] = [{"type": "function", "function": f} for f in functions]
        rendered = [dict(m) for m in messages]
    else:
        rendered = _as_text(messages, _system_text(functions, parallel_tool_calls))
    markers = FAMILIES[chat_format].markers
    return ToolSpec(
        rendered,
        variables,
        chat_format,
        grammar,
        () if required else triggers,
        markers + think,
        opens,
    )
