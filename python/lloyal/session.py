"""A conversation on one trunk branch.

A :class:`Session` keeps the chat's messages and a branch whose KV holds
exactly the rendered chat. Appending a turn renders the whole chat with the
template again and decodes only what changed: the text after the longest
prefix the branch already holds, cut at a token boundary. For templates
that only ever append (ChatML, Gemma, Llama 3) that is the new turn alone;
a template that rewrites earlier text (one that drops old reasoning, say)
costs a re-decode from the first changed token, never a wrong cache.

The delta is found by comparing rendered text, never by guessing strings:
the session knows the bytes each of its tokens stands for.

Length: every public method carries a runnable example (tests/test_docs.py
checks it), about a hundred lines of this file; the code is under 550.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from lloyal._generation import Generation
from lloyal._held import Held, upgrade, with_keys
from lloyal.branch import Branch
from lloyal.chat.format import check_messages
from lloyal.chat.output import ChatOutput
from lloyal.errors import StateError
from lloyal.media import portable_content
from lloyal.sampling import SamplingParams

if TYPE_CHECKING:
    from lloyal.chat.prompt import ChatPrompt
    from lloyal.context import Context

__all__ = ["Session"]

_MAGIC = b"LLOYAL-SESSION\x003"
# Format 2 keyed media between NUL bytes (read, and upgraded).
_MAGIC_2 = b"LLOYAL-SESSION\x002"


class Session:
    """A conversation that grows turn by turn on one branch.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         async with await lloyal.Session.create(ctx, params=lloyal.GREEDY) as chat:
    ...             await chat.add_user("Say hello.")
    ...             reply = await chat.reply(max_tokens=8)
    ...             delta = chat.last_delta  # closing the turn: <|im_end|> and a newline
    ...             return bool(reply.content), [m["role"] for m in chat.messages], delta
    >>> asyncio.run(main())
    (True, ['user', 'assistant'], 2)

    Create one with :meth:`create` (or :meth:`load`); add turns with
    :meth:`add_user`, :meth:`add_assistant` and :meth:`add_tool_result`;
    let the model answer with :meth:`generate` (streaming) or
    :meth:`reply`. :meth:`fork` explores another answer without touching
    this session; :meth:`save` and :meth:`load` keep it across processes.
    """

    def __init__(
        self,
        ctx: Context,
        branch: Branch,
        *,
        messages: list[dict[str, Any]],
        chat_options: dict[str, Any],
        held: Held,
    ) -> None:
        self._ctx = ctx
        self._branch = branch
        self._messages = messages
        self._options = chat_options
        # The bytes the branch's tokens stand for, and where each token ends.
        self._held = held
        self.tokens_decoded = 0
        """Tokens this session object has decoded (prefills and generation)."""
        self.last_delta = 0
        """Tokens the last change of the chat decoded."""
        self._last_output = ChatOutput(content="")

    @classmethod
    async def create(
        cls,
        ctx: Context,
        messages: Sequence[Mapping[str, Any]] = (),
        *,
        params: SamplingParams | None = None,
        template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        enable_thinking: bool | None = None,
    ) -> Session:
        """A session starting from ``messages`` (decoded now, if any), on a
        new root branch with ``params``. ``template``, ``tools`` and the
        rest are passed to :meth:`Context.format_chat` on every turn.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         history = [{"role": "system", "content": "Be brief."}]
        ...         async with await lloyal.Session.create(ctx, history) as chat:
        ...             return [m["role"] for m in chat.messages], chat.branch.position > 0
        >>> asyncio.run(main())
        (['system'], True)
        """
        options: dict[str, Any] = {
            "template": template,
            "tools": list(tools) if tools else None,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel_tool_calls,
            "enable_thinking": enable_thinking,
        }
        branch = Branch.create(ctx, params)
        session = cls(ctx, branch, messages=[], chat_options=options, held=Held())
        try:
            if messages:
                await session.extend(messages)
        except BaseException:
            await branch.prune()
            raise
        return session

    # -- reading ---------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A copy of the conversation so far."""
        return [dict(m) for m in self._messages]

    @property
    def branch(self) -> Branch:
        """The trunk branch (its KV holds the rendered chat)."""
        return self._branch

    @property
    def text(self) -> str:
        """The text the branch's KV holds (a :data:`MEDIA_MARKER
        <lloyal.MEDIA_MARKER>` for each medium)."""
        return self._held.text

    def render(self, *, add_generation_prompt: bool = True) -> ChatPrompt:
        """The whole chat rendered now (what the branch is synced to).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("Hi")
        ...             prompt = chat.render().prompt  # what the branch holds
        ...             return prompt.endswith("assistant\\n"), chat.text == prompt
        >>> asyncio.run(main())
        (True, True)
        """
        return self._ctx.format_chat(
            self._messages,
            add_generation_prompt=add_generation_prompt,
            **self._options,
        )

    # -- adding turns ------------------------------------------------------------

    async def add_user(self, content: str | Sequence[Mapping[str, Any]]) -> None:
        """Append a user message and decode it with the assistant's turn
        opener, ready for :meth:`generate`. ``content`` is text, or content
        parts holding images and audio (see :mod:`lloyal.media`; the
        context needs a projector).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("What is 2 + 2?")
        ...             return chat.messages[-1], chat.last_delta > 0
        >>> asyncio.run(main())
        ({'role': 'user', 'content': 'What is 2 + 2?'}, True)
        """
        if isinstance(content, str):
            await self.extend([{"role": "user", "content": content}])
            return
        parts: list[dict[str, Any]] = []
        for p in content if isinstance(content, Sequence) else [None]:
            if not isinstance(p, Mapping):
                raise TypeError("content must be str or a list of content parts (dicts)")
            parts.append(dict(p))
        await self.extend([{"role": "user", "content": parts}])

    async def add_assistant(
        self, content: str | None = None, *, tool_calls: Sequence[Mapping[str, Any]] | None = None
    ) -> None:
        """Append an assistant message written elsewhere (not generated).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("Say hi.")
        ...             await chat.add_assistant("Hi!")  # a turn written for the model
        ...             return [m["role"] for m in chat.messages]
        >>> asyncio.run(main())
        ['user', 'assistant']
        """
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = [dict(c) for c in tool_calls]
        await self.extend([message], add_generation_prompt=False)

    async def add_tool_result(
        self, content: str, *, tool_call_id: str | None = None, name: str | None = None
    ) -> None:
        """Append the result of a tool call, then the assistant's opener.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("Is it sunny?")
        ...             call = {"id": "c1", "type": "function",
        ...                     "function": {"name": "weather", "arguments": "{}"}}
        ...             await chat.add_assistant(tool_calls=[call])
        ...             await chat.add_tool_result("sunny", tool_call_id="c1")
        ...             return [m["role"] for m in chat.messages]
        >>> asyncio.run(main())
        ['user', 'assistant', 'tool']
        """
        message: dict[str, Any] = {"role": "tool", "content": _text(content)}
        if tool_call_id is not None:
            message["tool_call_id"] = tool_call_id
        if name is not None:
            message["name"] = name
        await self.extend([message])

    async def extend(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool | None = None
    ) -> None:
        """Append ``messages`` and sync the branch (decoding only the new
        text). The generation prompt is added unless the last message is
        the assistant's. On an error the session is unchanged: a malformed
        message is refused (:func:`lloyal.chat.check_messages`)
        before anything is rendered.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.extend([{"role": "user", "content": "Hi"},
        ...                                {"role": "assistant", "content": "Hello!"}])
        ...             # The last message is the assistant's: no generation prompt.
        ...             return len(chat.messages), chat.text == chat.render(
        ...                 add_generation_prompt=False).prompt
        >>> asyncio.run(main())
        (2, True)
        """
        check_messages(messages)
        # Media as parts JSON can carry (the messages are saved as JSON).
        new = [{**m, "content": portable_content(m.get("content"))} for m in messages]
        if add_generation_prompt is None:
            add_generation_prompt = not new or new[-1]["role"] != "assistant"
        before = self._messages
        self._messages = before + new
        try:
            await self._sync(self.render(add_generation_prompt=add_generation_prompt))
        except BaseException:
            self._messages = before
            raise

    # -- generating --------------------------------------------------------------

    async def generate(
        self, *, max_tokens: int = 512, constrain: bool = True, reasoning_budget: int = -1
    ) -> AsyncIterator[str]:
        """Let the model answer: yields text pieces as they are decoded.
        With tools, the chat's grammar keeps a tool call well formed (lazy
        with ``tool_choice="auto"``; a call is forced with ``"required"``);
        ``constrain=False`` lets this answer go unconstrained (say, prose
        after a required call's result) without changing the prompt.
        When the answer ends (a stop token, ``max_tokens``, or the loop
        leaving early), it is added to :attr:`messages`, parsed into
        content and tool calls, and the turn is closed in the KV.
        ``reasoning_budget``: at most that many tokens of reasoning, then
        the end-of-thinking marker is written for the model
        (:class:`lloyal.ReasoningBudget`; negative: no limit).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx, params=lloyal.GREEDY) as chat:
        ...             await chat.add_user("Count to three.")
        ...             pieces = [p async for p in chat.generate(max_tokens=8)]
        ...             return len(pieces) > 0, chat.messages[-1]["role"]
        >>> asyncio.run(main())
        (True, 'assistant')
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        chat = self.render()
        await self._sync(chat)
        grammar = chat.create_grammar(self._ctx) if constrain else None
        branch = self._branch
        if grammar is not None:
            branch.set_grammar(grammar)
        preserved = set(chat.preserved_tokens)
        gen = Generation(
            self._ctx,
            max_tokens=max_tokens,
            stop_tokens=set(chat.stop_tokens),
            preserved=preserved,
            budget=chat.reasoning_budget(self._ctx, reasoning_budget),
        )
        # The answer's bytes, joined onto what the branch holds at the end
        # (appending to one bytes object per token would copy it each time).
        held: list[bytes] = []
        try:
            async with contextlib.aclosing(gen.drive(branch)) as steps:
                async for step in steps:
                    if step.token is not None:
                        self.tokens_decoded += 1
                        special = step.token in preserved
                        held.append(self._ctx.token_bytes(step.token, render_special=special))
                    if step.text:
                        yield step.text
        finally:
            self._held.extend(held)
            if grammar is not None:
                branch.set_grammar(None)
            gen.close()  # (left early: the text held back is the answer's too)
            await self._close_turn(chat.parse(gen.text))

    async def reply(
        self, *, max_tokens: int = 512, constrain: bool = True, reasoning_budget: int = -1
    ) -> ChatOutput:
        """:meth:`generate` to the end; returns the parsed answer.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx, params=lloyal.GREEDY) as chat:
        ...             await chat.add_user("Name a colour.")
        ...             out = await chat.reply(max_tokens=8)
        ...             return out.content == chat.messages[-1]["content"], len(out.tool_calls)
        >>> asyncio.run(main())
        (True, 0)
        """
        async for _ in self.generate(
            max_tokens=max_tokens, constrain=constrain, reasoning_budget=reasoning_budget
        ):
            pass
        return self.last_output

    @property
    def last_output(self) -> ChatOutput:
        """The last assistant message, parsed (content, reasoning, calls)."""
        return self._last_output

    async def _close_turn(self, output: ChatOutput) -> None:
        self._last_output = output
        message: dict[str, Any] = {"role": "assistant", "content": output.content}
        if output.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id or f"call_{len(self._messages)}_{i}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for i, call in enumerate(output.tool_calls)
            ]
        await self.extend([message], add_generation_prompt=False)

    # -- branching and persistence --------------------------------------------------

    async def fork(self) -> Session:
        """An independent session continuing from here: it shares this
        session's KV prefix and diverges on its own.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         async with await lloyal.Session.create(ctx, params=lloyal.GREEDY) as chat:
        ...             await chat.add_user("Name a colour.")
        ...             async with await chat.fork() as other:
        ...                 await other.reply(max_tokens=4)
        ...                 return len(chat.messages), len(other.messages)
        >>> asyncio.run(main())
        (1, 2)
        """
        child = await self._branch.fork()
        twin = Session(
            self._ctx,
            child,
            messages=self.messages,
            chat_options=dict(self._options),
            held=self._held.copy(),
        )
        return twin

    async def save(self) -> bytes:
        """The session as bytes: messages, options and the branch's state
        (:meth:`Branch.save`). Tools and messages must be JSON-serialisable.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("Hi")
        ...             data = await chat.save()
        ...         async with await lloyal.Session.load(ctx, data) as again:
        ...             return again.messages, again.text == chat.text
        >>> asyncio.run(main())
        ([{'role': 'user', 'content': 'Hi'}], True)
        """
        meta = json.dumps(
            {
                "messages": self._messages,
                "options": self._options,
                "held": self._held.data.hex(),
                "ends": self._held.ends,
            }
        ).encode()
        state = await self._branch.save()
        return _MAGIC + struct.pack("<QI", len(meta), zlib.crc32(meta)) + meta + state

    async def save_file(self, path: str | os.PathLike[str]) -> None:
        """:meth:`save` to a file.

        >>> import asyncio, lloyal, os, tempfile
        >>> async def main():
        ...     path = os.path.join(tempfile.mkdtemp(), "chat.session")
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.Session.create(ctx) as chat:
        ...             await chat.add_user("Hi")
        ...             await chat.save_file(path)
        ...         async with await lloyal.Session.load_file(ctx, path) as again:
        ...             return len(again.messages)
        >>> asyncio.run(main())
        1
        """
        data = await self.save()
        await anyio.Path(path).write_bytes(data)

    @classmethod
    async def load(
        cls, ctx: Context, data: bytes, *, params: SamplingParams | None = None
    ) -> Session:
        """A session from :meth:`save` bytes, on a new branch of ``ctx``
        (same model). Damaged or foreign data raises :class:`StateError`.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         try:
        ...             await lloyal.Session.load(ctx, b"not a session")
        ...         except lloyal.StateError as e:
        ...             return str(e)
        >>> asyncio.run(main())
        'not a saved lloyal session'
        """
        raw = bytes(data)
        head = len(_MAGIC) + 12
        old = raw.startswith(_MAGIC_2)
        if len(raw) < head or not (raw.startswith(_MAGIC) or old):
            raise StateError("not a saved lloyal session")
        size, crc = struct.unpack("<QI", raw[len(_MAGIC) : head])
        if zlib.crc32(raw[head : head + size]) != crc:
            raise StateError("the saved session is damaged (checksum mismatch)")
        try:
            meta = json.loads(raw[head : head + size])
            held = bytes.fromhex(meta["held"])
            held = upgrade(held) if old else held
            ends = [int(e) for e in meta["ends"]]
            messages = list(meta["messages"])
            options = dict(meta["options"])
        except (ValueError, KeyError, TypeError) as e:
            raise StateError(f"the saved session is damaged: {e}") from None
        branch = await Branch.restore(ctx, raw[head + size :], params=params)
        if branch.position != len(ends):
            await branch.prune()
            raise StateError("the saved session's text and KV state disagree")
        return cls(ctx, branch, messages=messages, chat_options=options, held=Held(held, ends))

    @classmethod
    async def load_file(
        cls, ctx: Context, path: str | os.PathLike[str], *, params: SamplingParams | None = None
    ) -> Session:
        """:meth:`load` from a file written by :meth:`save_file`.

        (See :meth:`save_file`.)

        >>> import asyncio, lloyal, os, tempfile
        >>> async def main():
        ...     path = os.path.join(tempfile.mkdtemp(), "empty.session")
        ...     open(path, "wb").close()
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         try:
        ...             await lloyal.Session.load_file(ctx, path)
        ...         except lloyal.StateError:
        ...             return "refused"
        >>> asyncio.run(main())
        'refused'
        """
        return await cls.load(ctx, await anyio.Path(path).read_bytes(), params=params)

    async def aclose(self) -> None:
        """Prune the trunk branch (its lease goes back).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         chat = await lloyal.Session.create(ctx)
        ...         await chat.aclose()  # what leaving ``async with`` does
        ...         return chat.branch.disposed
        >>> asyncio.run(main())
        True
        """
        if not self._branch.disposed:
            await self._branch.prune()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _sync(self, chat: ChatPrompt) -> None:
        """Make the branch hold exactly ``chat``'s prompt (see
        :class:`lloyal._held.Held`)."""
        want, media = with_keys(chat)
        self.last_delta = await self._held.sync(self._ctx, self._branch, want, media)
        self.tokens_decoded += self.last_delta

    def __repr__(self) -> str:
        return f"<Session messages={len(self._messages)} tokens={self._held.tokens}>"


def _text(content: object) -> str:
    if not isinstance(content, str):
        raise TypeError(f"content must be str, got {type(content).__name__}")
    return content
