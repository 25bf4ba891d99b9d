"""The state a program writes to: text, chat turns, generations and choices
on one branch, forked into siblings that share its KV prefix.

Length: every public method carries a runnable example (tests/test_docs.py
checks it), about a hundred lines of this file; the code is under 530.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lloyal import _check
from lloyal._generation import Generation
from lloyal._held import Held
from lloyal.branch import Branch
from lloyal.errors import StateError
from lloyal.programs._roles import Chat, Turn
from lloyal.programs._select import choose
from lloyal.sampling import SamplingParams

if TYPE_CHECKING:
    from lloyal.context import Context

__all__ = ["ProgramState"]


class ProgramState:
    """What a program's ``s`` is: the text so far on a branch, and the
    values its generations and choices captured.

    ``s += "text"`` and ``s += lloyal.user("...")`` append (decoded lazily,
    together, at the next ``gen``, ``select`` or ``fork``); ``await
    s.gen("name", ...)`` generates and captures ``s["name"]``; ``await
    s.select("name", choices)`` picks one choice by its log-probability;
    ``await s.fork(n)`` makes ``n`` states that share this one's KV prefix.
    Make one with :meth:`lloyal.Program.run` (or :meth:`open` for a state
    outside a program).

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
    ...         async with await lloyal.ProgramState.open(ctx) as s:
    ...             s += "The capital of France is"
    ...             city = await s.select("city", [" Paris", " London", " Rome"])
    ...             return city, s.text
    >>> asyncio.run(main())
    (' Paris', 'The capital of France is Paris')
    """

    def __init__(
        self,
        ctx: Context,
        branch: Branch,
        params: SamplingParams | None,
        chat: Chat,
        held: Held | None = None,
    ) -> None:
        self._ctx = ctx
        self._branch: Branch | None = branch
        self._params = params
        self._chat = chat
        self._text = ""
        # What the branch holds (as a Session's does), the text appended
        # since, and the whole text to hold instead when a chat template
        # rewrote earlier text (synced by the next flush).
        self._held = held if held is not None else Held(base=branch.position)
        self._pending = ""
        self._want: bytes | None = None
        # A generation's last token: chosen (accepted by the sampler), not
        # decoded yet. It waits for whatever comes next, so that it is
        # decoded with it, or never if the state ends.
        self._deferred: int | None = None
        self._captures: dict[str, Any] = {}
        self._scores: dict[str | None, list[tuple[float, int]]] = {}
        self._forks = 0  # forks made so far (their seeds differ)
        # The fork states made here: closed with this one if the program
        # left them open (their leases come back when it ends).
        self._children: list[ProgramState] = []
        self.result: Any = None
        """What the program function returned (set by :meth:`Program.run`)."""

    @classmethod
    async def open(
        cls,
        source: Context | Branch,
        *,
        params: SamplingParams | None = None,
        chat_template: str | None = None,
    ) -> ProgramState:
        """A new state on a context (a new branch: one KV lease) or on a
        fork of ``source`` if it is a branch (the branch's text is not
        known to the state; ``text`` holds only what is appended).
        ``chat_template``: the template chat turns render with (Jinja
        source or a built-in name, as :meth:`Context.format_chat` takes;
        default: the model's).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         trunk = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         await trunk.prefill(await ctx.tokenize("Roses are red,"))
        ...         before = trunk.position
        ...         async with await lloyal.ProgramState.open(trunk) as s:  # a fork of trunk
        ...             s += " violets are"
        ...             await s.gen("colour", max_tokens=2)
        ...             return s.text.startswith(" violets are"), trunk.position == before
        >>> asyncio.run(main())
        (True, True)
        """
        from lloyal.context import Context

        if params is not None:
            _check.instance(params, SamplingParams, "params", "a SamplingParams")
        if isinstance(source, Branch):
            branch = await source.fork(root=True)
            ctx = source._ctx
            branch.set_sampler_params(params or branch.sampler_params)
        elif isinstance(source, Context):
            ctx = source
            branch = Branch.create(ctx, params or SamplingParams())
        else:
            raise TypeError(f"source must be a Context or a Branch, got {type(source).__name__}")
        return cls(ctx, branch, params or branch.sampler_params, Chat(chat_template))

    # -- what it holds ---------------------------------------------------------

    @property
    def text(self) -> str:
        """Everything appended and generated, as text (chat turns as their
        template renders them)."""
        return self._text

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat turns appended so far (with an open assistant turn's
        content once it is closed)."""
        return [dict(m) for m in self._chat.messages]

    @property
    def captures(self) -> dict[str, Any]:
        """Every named value captured so far."""
        return dict(self._captures)

    @property
    def branch(self) -> Branch:
        """The branch holding the decoded text. Pending appends, and the
        last token of the last generation, are decoded by the next
        ``gen``, ``select``, ``fork`` or :meth:`flush`."""
        return self._live()

    def __getitem__(self, name: str) -> Any:
        return self._captures[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The capture ``name``, or ``default`` when there is none.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "1, 2, 3,"
        ...             await s.gen("next", max_tokens=2, stop=",")
        ...             return s.get("next"), s.get("missing", "-")
        >>> asyncio.run(main())
        (' 4', '-')
        """
        return self._captures.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._captures

    def __iadd__(self, other: str | Turn) -> ProgramState:
        self._live()
        if isinstance(other, Turn):
            mark = (len(self._text), len(self._stream()))
            added, rendered = self._chat.add(self._ctx, other)
            if self._chat.start is None:
                self._chat.start = mark
            if added is not None:
                self._append(added)
            else:
                # The template rewrote earlier text: the chat's text is the
                # new render, and the next flush syncs the branch to it.
                chars, at = self._chat.start
                self._want = self._stream()[:at] + rendered.encode()
                self._text = self._text[:chars] + rendered
                self._pending = ""
        elif isinstance(other, str):
            self._chat.append_text(other)
            self._append(other)
        else:
            raise TypeError(
                f"a program appends str or a turn (lloyal.user(...)), got {type(other).__name__}"
            )
        return self

    def _append(self, text: str) -> None:
        self._text += text
        if self._want is not None:
            self._want += text.encode()
        else:
            self._pending += text

    def _stream(self) -> bytes:
        """The bytes the branch is to hold once flushed."""
        if self._want is not None:
            return self._want
        deferred = self._deferred
        last = b"" if deferred is None else self._ctx.token_bytes(deferred, render_special=True)
        return self._held.data + last + self._pending.encode()

    def _live(self) -> Branch:
        if self._branch is None:
            raise StateError("this program state is closed (its program ended or was joined)")
        return self._branch

    async def flush(self) -> None:
        """Decode what was appended and not decoded yet (with the last
        generated token, which waits for this: a program that ends after
        a generation never decodes it), in one decode.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "Once upon a time"
        ...             before = s.branch.position
        ...             await s.flush()  # gen, select and fork flush by themselves
        ...             return before, s.branch.position > 0
        >>> asyncio.run(main())
        (0, True)
        """
        branch = self._live()
        if not self._pending and self._deferred is None and self._want is None:
            return
        # Session's delta sync: the deferred token is decoded as itself,
        # what follows it tokenized; a rewritten chat is re-decoded from
        # its first changed token.
        first = () if self._deferred is None else (self._deferred,)
        await self._held.sync(self._ctx, branch, self._stream(), first=first)
        self._pending = ""
        self._deferred = None
        self._want = None

    # -- generation ------------------------------------------------------------

    async def gen(
        self,
        name: str | None = None,
        *,
        max_tokens: int = 128,
        stop: str | Sequence[str] | None = None,
        regex: str | None = None,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        choices: Sequence[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> str:
        """Generate until the end of the model's turn, a ``stop`` string
        (not kept) or ``max_tokens``; append the text and capture it as
        ``s[name]``. ``regex=`` / ``json_schema=`` constrain it (a grammar
        for this generation only); ``choices=`` is :meth:`select`.
        ``temperature`` / ``top_p`` change the state's sampling for this
        generation (``temperature=0``: greedy).

        Forks generating under ``asyncio.gather`` share one decode per step.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "Q: What is 2 + 2?\\nA:"
        ...             await s.gen("answer", max_tokens=4, regex=" [0-9]+")
        ...             return s["answer"][0], s["answer"][1:].isdigit()
        >>> asyncio.run(main())
        (' ', True)
        """
        if choices is not None:
            return await self.select(name, choices)
        parts = [
            piece
            async for piece in self.gen_stream(
                name,
                max_tokens=max_tokens,
                stop=stop,
                regex=regex,
                json_schema=json_schema,
                temperature=temperature,
                top_p=top_p,
            )
        ]
        return "".join(parts)

    async def gen_stream(
        self,
        name: str | None = None,
        *,
        max_tokens: int = 128,
        stop: str | Sequence[str] | None = None,
        regex: str | None = None,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> AsyncIterator[str]:
        """:meth:`gen`, yielding the text as it comes (held back only while
        it could be the start of a ``stop`` string). The capture is set
        when the stream ends.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "1, 2, 3,"
        ...             pieces = [p async for p in s.gen_stream("more", max_tokens=6, stop=",")]
        ...             return "".join(pieces) == s["more"], s["more"]
        >>> asyncio.run(main())
        (True, ' 4')
        """
        _check.integer(max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        stops = _stops(stop)
        branch = self._live()
        await self.flush()
        # The grammar first: one that is refused leaves the state as it was
        # (its sampling too).
        grammar = _grammar(regex, json_schema)
        if grammar is not None:
            branch.set_grammar(**grammar)
        try:
            changed = self._sampling(temperature, top_p)
        except BaseException:
            if grammar is not None:
                branch.set_grammar()
            raise
        start = branch.position
        # Where a stop string cuts every generated token off, the branch
        # goes back to here, logits and all.
        logits_at_start = branch.logits if stops else None
        gen = Generation(self._ctx, max_tokens=max_tokens, stop=stops)
        final = ""
        try:
            async with contextlib.aclosing(gen.drive(branch, last=branch.accept)) as steps:
                async for step in steps:
                    if step.finish == "length" and step.token is not None:
                        self._deferred = step.token  # decoded by the next flush
                    if step.finish is not None:
                        final = step.text  # shown once the branch holds the text
                        break
                    if step.text:
                        yield step.text
            if gen.cut is not None:
                # Keep the tokens wholly before the stop string, the last of
                # them undecoded (as after any generation, so the branch has
                # logits to go on from); the rest of the text before the stop
                # is appended again as text. (The token that completed the
                # stop string was never decoded.)
                keep = gen.kept
                if keep == 0:
                    if branch.position > start:
                        await branch.truncate(start, logits=logits_at_start)
                elif branch.position > start + keep:
                    await branch.truncate(start + keep - 1)
                    self._deferred = gen.tokens[keep - 1]
                self._pending += gen.text[(gen.ends[keep - 1] if keep else 0) : gen.cut]
            if final:
                yield final
        finally:
            if grammar is not None:
                branch.set_grammar()
            if changed is not None:
                branch.set_sampler_params(changed)
            # Also when the stream is closed early or a step fails: the
            # text is what the branch holds.
            gen.close()
            if not branch.disposed:  # the tokens of this generation the branch holds
                decoded = gen.tokens[: branch.position - start]
                self._held.extend([self._ctx.token_bytes(t, render_special=True) for t in decoded])
            out = gen.output
            self._text += out
            self._chat.append_text(out)
            if name is not None:
                self._captures[name] = out

    def _sampling(self, temperature: float | None, top_p: float | None) -> SamplingParams | None:
        """Apply per-generation sampling; return the params to restore."""
        if temperature is None and top_p is None:
            return None
        changes: dict[str, float] = {}
        if temperature is not None:
            changes["temperature"] = float(temperature)
        if top_p is not None:
            changes["top_p"] = float(top_p)
        branch = self._live()
        before = branch.sampler_params
        branch.set_sampler_params(before.with_(**changes))
        return before

    async def select(
        self,
        name: str | None,
        choices: Sequence[str],
        *,
        normalize: bool = True,
    ) -> str:
        """Append the choice the model finds most likely here and capture
        it. Every choice is scored in one decode (``prefill_tree``: a prefix
        that choices share is decoded once), given enough free KV leases
        (``len(choices) - 1``; with fewer, choices are scored one by one on
        this branch, each decoded and cut off again, which needs none).
        ``normalize=True`` compares the mean log-probability per token (SGLang's
        default), ``False`` the sum. ``s.scores[name]`` keeps each choice's
        sum of log-probabilities (nats) and token count.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "The sky is"
        ...             await s.select("colour", [" blue", " green"])
        ...             (lp_blue, n_blue), _ = s.scores["colour"]
        ...             return s["colour"], n_blue, lp_blue < 0
        >>> asyncio.run(main())
        (' blue', 1, True)
        """
        branch = self._live()
        await self.flush()
        start = branch.position
        picked, scores, kept = await choose(self._ctx, branch, choices, normalize=normalize)
        if kept is not branch:
            await branch.prune()
            self._branch = kept
        text = choices[picked]
        decoded = self._ctx.tokenize_sync(text, add_special=False)[: kept.position - start]
        self._held.extend([self._ctx.token_bytes(t) for t in decoded])
        self._text += text
        self._chat.append_text(text)
        self._scores[name] = scores
        if name is not None:
            self._captures[name] = text
        return text

    @property
    def scores(self) -> dict[str | None, list[tuple[float, int]]]:
        """Per :meth:`select` name, each choice's ``(sum of log-probs, tokens)``."""
        return self._scores

    # -- forks -----------------------------------------------------------------

    async def fork(self, n: int) -> list[ProgramState]:
        """``n`` states that continue from this one: each a KV fork (the
        decoded prefix is shared, not copied) with a copy of the text, the
        chat turns and the captures. Each fork's sampler gets a random
        stream of its own, so sampled generations differ; with a ``seed``
        in the sampling params, fork ``i`` of a state is seeded from it and
        ``i`` (reproducible). Raises :class:`NoLeaseError` when fewer than
        ``n`` leases are free (none made).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "My favourite fruit is"
        ...             forks = await s.fork(2)
        ...             for f in forks:
        ...                 await f.gen("fruit", max_tokens=3)
        ...             await s.join(forks)
        ...             return [f.closed for f in forks], all(f["fruit"] for f in forks)
        >>> asyncio.run(main())
        ([True, True], True)
        """
        _check.integer(n, "n")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        branch = self._live()
        await self.flush()
        forks: list[ProgramState] = []
        try:
            base = branch.sampler_params.seed
            for i in range(n):
                child = await branch.fork(root=True)
                seed = random.getrandbits(32) if base is None else _fork_seed(base, self._forks + i)
                child.reseed_sampler(seed)
                state = ProgramState(
                    self._ctx, child, self._params, self._chat.copy(), self._held.copy()
                )
                state._text = self._text
                state._captures = dict(self._captures)
                forks.append(state)
        except BaseException:
            for state in forks:
                await state.close()
            raise
        self._forks += n
        self._children += forks
        return forks

    async def join(self, forks: Sequence[ProgramState]) -> None:
        """Close ``forks`` (their KV comes back); their text and captures
        stay readable.

        (See :meth:`fork`.)

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=3) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx) as s:
        ...             s += "Hi"
        ...             forks = await s.fork(2)
        ...             free = lloyal.BranchStore(ctx).available
        ...             await s.join(forks)
        ...             return free, lloyal.BranchStore(ctx).available
        >>> asyncio.run(main())
        (0, 2)
        """
        for state in forks:
            if not isinstance(state, ProgramState):
                raise TypeError(f"join takes program states, got {type(state).__name__}")
        for state in forks:
            await state.close()

    async def close(self) -> None:
        """Free this state's branch, and those of its forks the program left
        open; text and captures stay readable.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         s = await lloyal.ProgramState.open(ctx)
        ...         s += "Hi"
        ...         await s.close()  # what leaving ``async with`` does
        ...         return s.closed, s.text
        >>> asyncio.run(main())
        (True, 'Hi')
        """
        children, self._children = self._children, []
        for child in children:  # forks the program did not join
            await child.close()
        branch, self._branch = self._branch, None
        if branch is not None and not branch.disposed:
            await branch.prune()

    @property
    def closed(self) -> bool:
        return self._branch is None

    def snapshot(self) -> dict[str, Any]:
        """What a finished state holds, as plain data (what a cluster
        worker sends back; :meth:`from_snapshot` reads it).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=4) as ctx:
        ...         async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
        ...             s += "1, 2, 3,"
        ...             await s.gen("next", max_tokens=2, stop=",")
        ...             data = s.snapshot()
        ...         again = lloyal.ProgramState.from_snapshot(ctx, data)
        ...         return sorted(data), again["next"], again.closed
        >>> asyncio.run(main())
        (['captures', 'messages', 'result', 'scores', 'text'], ' 4', True)
        """
        return {
            "text": self._text,
            "captures": dict(self._captures),
            "messages": self.messages,
            "scores": dict(self._scores),
            "result": self.result,
        }

    @classmethod
    def from_snapshot(cls, ctx: Any, data: Mapping[str, Any]) -> ProgramState:
        """A closed state holding ``data`` (from :meth:`snapshot`).

        (See :meth:`snapshot`.)

        >>> import lloyal
        >>> data = {"text": "Hi", "captures": {"x": 1}, "messages": [], "scores": {}, "result": 2}
        >>> s = lloyal.ProgramState.from_snapshot(None, data)
        >>> s["x"], s.result, s.closed
        (1, 2, True)
        """
        state = cls.__new__(cls)
        state._ctx = ctx
        state._branch = None
        state._params = None
        state._chat = Chat()
        state._chat.messages = [dict(m) for m in data["messages"]]
        state._text = data["text"]
        state._held = Held()
        state._pending = ""
        state._want = None
        state._deferred = None
        state._captures = dict(data["captures"])
        state._scores = dict(data["scores"])
        state._forks = 0
        state._children = []
        state.result = data["result"]
        return state

    async def __aenter__(self) -> ProgramState:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self._branch is None else f"position={self._branch.position}"
        return f"<lloyal.ProgramState {state} captures={sorted(map(str, self._captures))}>"


def _fork_seed(seed: int, i: int) -> int:
    """The seed of fork ``i`` of a state sampling with ``seed``."""
    return (seed * 1_000_003 + i + 1) % (1 << 32)


def _stops(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError("stop must be a non-empty string or a sequence of them")
    return items


def _grammar(
    regex: str | None, json_schema: Mapping[str, Any] | str | bool | None
) -> dict[str, Any] | None:
    if regex is not None and json_schema is not None:
        raise ValueError("give regex= or json_schema=, not both")
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a str, got {type(regex).__name__}")
        return {"lark": "start: /" + regex.replace("/", "\\/") + "/"}
    if json_schema is not None:
        return {"json_schema": json_schema}
    return None
