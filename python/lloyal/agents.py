"""Agents: a tool-calling loop on a :class:`~lloyal.Session`, and the few
ways to combine them that matter on forkable state.

Not a framework: an :class:`Agent` is a system prompt, tools and sampling;
:meth:`Agent.run` answers one task (reply, run the tools it called, append
their results, reply again, until it answers without calling). Tool calls
are written and read in the model's own chat family (``format_chat`` with
``tools=``: its grammar keeps a call well formed, ``parse_chat_output``
reads it back). Then:

- :func:`diverge`: one task, ``n`` attempts on KV forks of the session that
  holds the task (the prompt decoded once), run concurrently (their commits
  share decodes), the best kept by a score you give;
- :func:`fan_out`: several tasks at once, one session each;
- :func:`chain`: tasks in order, each seeing the previous answer.

Every step is reported to ``on_event`` as an :class:`Event` (for tracing).
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from lloyal._mcp import MCPToolError, mcp_tools
from lloyal._tasks import gather
from lloyal._tool import Tool
from lloyal.branch import BranchStore
from lloyal.session import Session

if TYPE_CHECKING:
    from lloyal.context import Context
    from lloyal.sampling import SamplingParams

__all__ = [
    "Agent",
    "AgentResult",
    "Diverged",
    "Event",
    "MCPToolError",
    "Tool",
    "chain",
    "diverge",
    "fan_out",
    "mcp_tools",
    "tool",
]

_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
) -> Any:
    """Make a function a :class:`Tool`. The parameters' schema comes from
    its annotations (``int``, ``float``, ``str``, ``bool``; none: ``str``;
    every parameter required) unless ``parameters=`` gives one; the
    description from its docstring.

    >>> from lloyal.agents import tool
    >>> @tool
    ... def add(a: int, b: int) -> int:
    ...     "Add two integers."
    ...     return a + b
    >>> add.schema()["function"]["parameters"]["properties"]
    {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}
    """

    def make(f: Callable[..., Any]) -> Tool:
        return Tool(
            name or f.__name__,
            description or inspect.getdoc(f) or f.__name__,
            parameters if parameters is not None else _parameters(f),
            f,
        )

    return make if fn is None else make(fn)


def _parameters(f: Callable[..., Any]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    hints = inspect.get_annotations(f, eval_str=True)
    for p in inspect.signature(f).parameters.values():
        kind = _TYPES.get(hints.get(p.name, str))
        if kind is None:
            raise TypeError(
                f"tool {f.__name__}: parameter {p.name!r} needs an int, float, str or bool "
                "annotation (or give parameters=)"
            )
        properties[p.name] = {"type": kind}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Event:
    """One step of an agent: ``kind`` is ``"reply"`` (a model turn),
    ``"tool_call"``, ``"tool_result"``, ``"answer"`` or ``"error"`` (a tool
    raised; its message went back to the model as the result)."""

    kind: str
    agent: str
    turn: int
    data: Mapping[str, Any]


@dataclass
class AgentResult:
    """What :meth:`Agent.run` returns."""

    answer: str
    """The content of the last reply (the one without tool calls)."""
    messages: list[dict[str, Any]]
    """The whole chat, tool calls and results included."""
    calls: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)
    """Each tool call made: name, arguments, result."""
    turns: int = 0
    """Model replies it took."""
    finished: bool = True
    """False when ``max_turns`` ran out before an answer."""


class Agent:
    """A system prompt, tools and sampling; :meth:`run` answers a task.

    ``tool_choice="required"`` makes the first reply a tool call (the
    grammar forces one) and lets the model answer freely once results are
    in; ``"auto"`` lets it decide on every turn (small models rarely call
    then). ``template`` as :meth:`Context.format_chat` takes it.

    >>> import asyncio, lloyal
    >>> from lloyal.agents import Agent, tool
    >>> @tool
    ... def add(a: int, b: int) -> int:
    ...     "Add two integers."
    ...     return a + b
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_ctx=2048) as ctx:
    ...         agent = Agent(ctx, tools=[add], tool_choice="required", params=lloyal.GREEDY)
    ...         result = await agent.run("What is 2 plus 3?")
    ...         name, arguments, value = result.calls[0]
    ...         return name, value == arguments["a"] + arguments["b"], result.finished
    >>> asyncio.run(main())
    ('add', True, True)
    """

    def __init__(
        self,
        ctx: Context,
        *,
        name: str = "agent",
        system: str | None = None,
        tools: Sequence[Tool] = (),
        tool_choice: str = "auto",
        params: SamplingParams | None = None,
        template: str | None = None,
        max_turns: int = 6,
        max_tokens: int = 256,
        on_event: Callable[[Event], Any] | None = None,
    ) -> None:
        if tool_choice not in ("auto", "required"):
            raise ValueError(f'tool_choice must be "auto" or "required", got {tool_choice!r}')
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"tools must be Tool objects (@lloyal.agents.tool), got {t!r}")
        if max_turns < 1 or max_tokens < 1:
            raise ValueError("max_turns and max_tokens must be >= 1")
        self.ctx = ctx
        self.name = name
        self.system = system
        self.tools = {t.name: t for t in tools}
        self.tool_choice = tool_choice
        self.params = params
        self.template = template
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.on_event = on_event

    async def open(self, task: str) -> Session:
        """A session holding the system prompt and ``task``, ready for the
        model's first reply (what :meth:`run` starts from; :func:`diverge`
        forks it)."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        session = await Session.create(
            self.ctx,
            messages,
            params=self.params,
            template=self.template,
            tools=[t.schema() for t in self.tools.values()] or None,
            tool_choice=self.tool_choice if self.tools else "auto",
        )
        try:
            await session.add_user(task)
        except BaseException:
            await session.aclose()
            raise
        return session

    async def run(self, task: str) -> AgentResult:
        """Answer ``task``: reply, run the tools called, append their
        results, and reply again until an answer comes without calls (or
        ``max_turns`` replies)."""
        async with await self.open(task) as session:
            return await self.continue_(session)

    async def continue_(self, session: Session) -> AgentResult:
        """Run the loop on a session already holding the task (see
        :meth:`open`)."""
        result = AgentResult("", [])
        for turn in range(self.max_turns):
            # A required call constrains the first reply only: after the
            # results the model answers (or writes another call) freely.
            constrain = self.tool_choice == "auto" or turn == 0
            reply = await session.reply(max_tokens=self.max_tokens, constrain=constrain)
            result.turns += 1
            await self._emit("reply", turn, content=reply.content, calls=len(reply.tool_calls))
            if not reply.tool_calls:
                result.answer = reply.content.strip()
                await self._emit("answer", turn, content=result.answer)
                break
            for call in reply.tool_calls:
                output = await self._call(turn, call.name, call.parsed_arguments(), result)
                await session.add_tool_result(output, tool_call_id=call.id, name=call.name)
        else:
            result.finished = False
        result.messages = session.messages
        return result

    async def _call(
        self, turn: int, name: str, arguments: dict[str, Any] | None, result: AgentResult
    ) -> str:
        await self._emit("tool_call", turn, name=name, arguments=arguments)
        found = self.tools.get(name)
        try:
            if found is None:
                raise LookupError(f"no tool named {name!r}")
            if arguments is None:
                raise ValueError("the arguments are not a JSON object")
            value = await found.call(arguments)
        except Exception as e:  # the model sees the error and may try again
            await self._emit("error", turn, name=name, error=repr(e))
            return json.dumps({"error": str(e)})
        result.calls.append((name, arguments, value))
        await self._emit("tool_result", turn, name=name, result=value)
        return value if isinstance(value, str) else json.dumps(value, default=str)

    async def _emit(self, kind: str, turn: int, **data: Any) -> None:
        if self.on_event is not None:
            out = self.on_event(Event(kind, self.name, turn, data))
            if inspect.isawaitable(out):
                await out


@dataclass
class Diverged:
    """What :func:`diverge` returns: every attempt, its score, the best."""

    results: list[AgentResult]
    scores: list[float]
    best: int

    @property
    def answer(self) -> AgentResult:
        return self.results[self.best]


async def diverge(
    agent: Agent,
    task: str,
    n: int,
    score: Callable[[AgentResult], float | Awaitable[float]],
    *,
    seed: int | None = None,
) -> Diverged:
    """``n`` attempts at ``task``: the task is decoded once into a session,
    forked ``n`` times (each fork's sampler reseeded, from ``seed`` when
    given), the loops run concurrently, and ``score`` (sync or async)
    picks the best. Needs ``n + 1`` free KV leases.

    >>> import asyncio, lloyal
    >>> from lloyal.agents import Agent, diverge
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_ctx=2048, n_seq_max=4) as ctx:
    ...         agent = Agent(ctx, params=lloyal.SamplingParams(temperature=0.9), max_tokens=12)
    ...         out = await diverge(agent, "Name a colour.", 3, lambda r: -len(r.answer), seed=1)
    ...         return len(out.results), out.scores[out.best] == max(out.scores)
    >>> asyncio.run(main())
    (3, True)
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    needed = n + 1
    if BranchStore(agent.ctx).available < needed:
        raise ValueError(
            f"diverge needs {needed} free KV leases, {BranchStore(agent.ctx).available} are"
        )
    rng = random.Random(seed)
    base = await agent.open(task)
    forks: list[Session] = []
    try:
        for _ in range(n):
            fork = await base.fork()
            fork.branch.reseed_sampler(rng.getrandbits(32))
            forks.append(fork)
        outcomes = await gather(*(agent.continue_(fork) for fork in forks))
        _raise_first(outcomes)
        done: list[AgentResult] = list(outcomes)
        scores = []
        for r in done:
            value = score(r)
            scores.append(float(await value if inspect.isawaitable(value) else value))
    finally:
        for fork in forks:
            await fork.aclose()
        await base.aclose()
    best = max(range(n), key=scores.__getitem__)
    return Diverged(done, scores, best)


async def fan_out(
    agents: Agent | Sequence[Agent], tasks: Sequence[str], *, concurrency: int | None = None
) -> list[AgentResult]:
    """Run each task (on ``agents[i]``, or all on one agent) at once, at
    most ``concurrency`` at a time (default: the free KV leases); results
    in task order. Their commits share decodes. If some raise, the others
    still finish, then the first error (in task order) is raised."""
    pool = [agents] * len(tasks) if isinstance(agents, Agent) else list(agents)
    if len(pool) != len(tasks):
        raise ValueError(f"{len(pool)} agents for {len(tasks)} tasks")
    if not pool:
        return []
    limit = anyio.Semaphore(concurrency or max(1, BranchStore(pool[0].ctx).available))

    async def one(i: int) -> AgentResult:
        async with limit:
            return await pool[i].run(tasks[i])

    outcomes = await gather(*(one(i) for i in range(len(tasks))))
    _raise_first(outcomes)
    return list(outcomes)


def _raise_first(outcomes: list[Any]) -> None:
    """Raise the first exception among ``outcomes`` (once all finished)."""
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


async def chain(agents: Agent | Sequence[Agent], tasks: Sequence[str]) -> list[AgentResult]:
    """Run tasks in order; ``{previous}`` in a task is replaced by the
    answer before it (empty for the first)."""
    pool = [agents] * len(tasks) if isinstance(agents, Agent) else list(agents)
    if len(pool) != len(tasks):
        raise ValueError(f"{len(pool)} agents for {len(tasks)} tasks")
    results: list[AgentResult] = []
    previous = ""
    for agent, task in zip(pool, tasks, strict=True):
        result = await agent.run(task.replace("{previous}", previous))
        results.append(result)
        previous = result.answer
    return results
