"""A chat choice's reply as typed deltas, whatever the API: each token's
piece parsed once (by :class:`~lloyal.ChatOutputStream`) into text,
reasoning, and tool-call starts and arguments, and the final reply. Each
API writes them in its own shape (``_openai.py``, ``_anthropic.py``)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from lloyal.chat.output import ChatOutput, ChatOutputStream
from lloyal.chat.prompt import ChatPrompt
from lloyal.context import Context
from lloyal.errors import ChatTemplateError, GrammarError, MediaError
from lloyal.grammar import Grammar
from lloyal.server._choice import Ending
from lloyal.server._engine import ChoiceEvent
from lloyal.server._protocol import ApiError, ChatRequest, RequestOptions
from lloyal.server._state import State


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    """More of the reply's content."""

    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """More of the reply's reasoning."""

    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins: its id, the function's name, and the arguments
    so far (JSON text, possibly partial)."""

    index: int
    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallArguments:
    """More of call ``index``'s arguments."""

    index: int
    arguments: str


Delta = TextDelta | ReasoningDelta | CallStart | CallArguments


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """A finished reply. ``finish``: ``"stop"``, ``"length"`` or
    ``"tool_calls"`` (it stopped after calling)."""

    content: str
    reasoning: str
    calls: tuple[Call, ...]
    finish: str


class ChatChoice:
    """One chat choice's text, parsed as it grows into typed deltas."""

    def __init__(self, prompt: ChatPrompt, *, split_reasoning: bool = True) -> None:
        self.prompt = prompt
        # False (reasoning_format "none"): the reasoning stays in the
        # content, between the family's markers.
        self.split_reasoning = split_reasoning
        self.text = ""  # a collected reply: the caller appends to it
        # A streamed reply goes through delta(), which parses only what each
        # piece can change.
        self.stream = ChatOutputStream(prompt.chat_format, thinking_started=prompt.thinking_started)
        self.seen = ChatOutput(content="")
        # Each call's id, from its start on (the model's, or one made here).
        self._ids: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.tokens = 0

    def delta(self, more: str) -> list[Delta]:
        """What ``more`` text adds to the reply."""
        return self._since_seen(self.stream.feed(more))

    def closing(self, finish: str) -> list[Delta]:
        """What the final parse has that the deltas did not send: text held
        back as a possible marker's start (the stream then ends as the
        whole reply would: see :meth:`final`)."""
        return self._since_seen(self._parsed(finish)) if self.stream.text else []

    def _parsed(self, finish: str) -> ChatOutput:
        """The whole reply parsed. A call that ``max_tokens`` cut off stays
        a call, with the arguments it got (as OpenAI and Anthropic report
        one), not its markup as text: streamed or not, the reply is the
        same, and its finish says it was cut (``ChatPrompt.parse_cut``)."""
        if finish == "length":
            return self.prompt.parse_cut(self.stream.text or self.text)
        return self.stream.finish() if self.stream.text else self.prompt.parse(self.text)

    def _view(self, out: ChatOutput) -> ChatOutput:
        """``out`` as the request asked for it (see ``split_reasoning``)."""
        if self.split_reasoning or not out.reasoning:
            return out
        opening, closing = self.prompt.think
        head = "" if self.prompt.thinking_started else opening
        closed = out.content or out.tool_calls or closing in (self.stream.text or self.text)
        tail = closing if closed else ""
        return dataclasses.replace(
            out, content=head + out.reasoning + tail + out.content, reasoning=""
        )

    def _id(self, j: int, given: str | None) -> str:
        while len(self._ids) <= j:
            self._ids.append("")
        if not self._ids[j]:
            self._ids[j] = given or f"call_{uuid.uuid4().hex[:24]}"
        return self._ids[j]

    def _since_seen(self, now: ChatOutput) -> list[Delta]:
        now = self._view(now)
        seen = self.seen
        out: list[Delta] = []
        if now.reasoning.startswith(seen.reasoning) and len(now.reasoning) > len(seen.reasoning):
            out.append(ReasoningDelta(now.reasoning[len(seen.reasoning) :]))
        if now.content.startswith(seen.content) and len(now.content) > len(seen.content):
            out.append(TextDelta(now.content[len(seen.content) :]))
        for j, call in enumerate(now.tool_calls):
            before = seen.tool_calls[j] if j < len(seen.tool_calls) else None
            if before is None:
                out.append(CallStart(j, self._id(j, call.id), call.name, call.arguments))
            elif len(call.arguments) > len(before.arguments):
                out.append(CallArguments(j, call.arguments[len(before.arguments) :]))
        self.seen = now
        return out

    def final(self, finish: str) -> Reply:
        """The whole reply (``finish``: why generation ended; a reply with
        calls that stopped finishes with ``"tool_calls"``)."""
        out = self._view(self._parsed(finish))
        calls = tuple(
            Call(self._id(j, c.id), c.name, c.arguments) for j, c in enumerate(out.tool_calls)
        )
        if calls and finish == "stop":
            finish = "tool_calls"
        return Reply(out.content, out.reasoning, calls, finish)


async def collect(choice: ChatChoice, events: AsyncIterator[ChoiceEvent]) -> tuple[str, str | None]:
    """Run one choice's ``events`` to the end, gathering its text; why it
    ended and the stop string that ended it, if one did."""
    finish, stop = "stop", None
    async for event in events:
        if event.finish is not None:
            finish, stop = event.finish, event.stop
        else:
            choice.text += event.text
    return finish, stop


def chat_prompt(ctx: Context, template: str | None, req: ChatRequest) -> ChatPrompt:
    """The request's messages and tools rendered (400 naming the messages
    when the template cannot take them). A final assistant message with
    text and no calls is a prefill: the reply continues it (Anthropic's
    Messages API; llama-server does the same for chat completions), so
    the chat is rendered without it, up to the assistant's opener, and
    its text follows."""
    messages = req.messages
    last = messages[-1] if messages else None
    prefill = ""
    if (
        len(messages) > 1
        and last is not None
        and last.get("role") == "assistant"
        and not last.get("tool_calls")
        and isinstance(last.get("content"), str)
        and last["content"]
    ):
        messages, prefill = messages[:-1], last["content"]
    try:
        prompt = ctx.format_chat(
            messages,
            template=template,
            tools=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            json_schema=req.json_schema,
            enable_thinking=req.enable_thinking,
            **_effort(req),
        )
    except (ChatTemplateError, ValueError, MediaError) as e:
        # The tools were checked with the request: what is left is the
        # messages' (text the template or its JSON cannot take).
        raise ApiError(f"the chat could not be rendered: {e}", param="messages") from None
    if prefill:
        prompt = dataclasses.replace(prompt, prompt=prompt.prompt + prefill)
    return prompt


async def prompt_tokens(ctx: Context, prompt: ChatPrompt) -> list[int]:
    """The prompt's tokens, its media as placeholders (400 for media the
    projector cannot read, or none loaded); one BOS where the template
    wrote one and the tokenizer added another."""
    if not prompt.media:
        tokens = await ctx.tokenize(prompt.prompt)
    elif ctx.projector is None:
        raise ApiError(
            "this server takes no images or audio (start it with --mmproj)", param="messages"
        )
    else:
        try:
            tokens = await ctx.tokenize(prompt.prompt, media=prompt.media)
        except MediaError as e:
            raise ApiError(str(e), param="messages") from None
    if len(tokens) > 1 and tokens[0] == tokens[1] == ctx.bos_token:
        tokens = tokens[1:]
    return tokens


async def prepare(state: State, req: ChatRequest) -> tuple[ChatPrompt, Grammar | None, list[int]]:
    """A chat request rendered, its grammar, and its tokens."""
    prompt = chat_prompt(state.ctx, state.config.template, req)
    grammar = chat_grammar(state.ctx, req, prompt)
    return prompt, grammar, await prompt_tokens(state.ctx, prompt)


def _effort(req: ChatRequest) -> dict[str, Any]:
    """``reasoning_effort``, a template variable, when the request sets it."""
    return {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else {}


def chat_grammar(ctx: Context, req: ChatRequest, prompt: ChatPrompt) -> Grammar | None:
    try:
        if req.grammar is not None:
            return ctx.create_grammar(req.grammar)
        return prompt.create_grammar(ctx)
    except GrammarError as e:
        if req.grammar is not None:
            param = "grammar"
        else:
            param = "response_format" if req.json_schema is not None else "tools"
        raise ApiError(str(e), param=param) from None


async def chat_events(
    state: State,
    tokens: list[int],
    gen: RequestOptions,
    prompt: ChatPrompt,
    grammar: Grammar | None,
) -> AsyncGenerator[ChoiceEvent, None]:
    """A chat request's events, once admitted (its reasoning budget: the
    request's, else the server's)."""
    async with state.engine.admitted(tokens, gen):
        limit = state.config.reasoning_budget
        if gen.reasoning_budget is not None:
            limit = gen.reasoning_budget
        ending = Ending(
            frozenset(prompt.stop_tokens),
            frozenset(prompt.preserved_tokens),
            (lambda: prompt.reasoning_budget(state.ctx, limit)) if limit >= 0 else None,
        )
        async for event in state.engine.generate(tokens, gen, grammar=grammar, ending=ending):
            yield event
