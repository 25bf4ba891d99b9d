"""Programs over branches: SGLang's ``gen`` / ``select`` / ``fork`` /
``join`` as a few lines of asyncio, on lloyal's forkable decode state.

A program is an ``async def`` taking a :class:`ProgramState` ``s`` first:

- ``s += "text"``, ``s += lloyal.user("...")`` append (chat turns as the
  model's template renders them);
- ``await s.gen("name", max_tokens=, stop=, regex=, json_schema=,
  temperature=)`` generates and captures ``s["name"]``;
  ``s.gen_stream(...)`` yields the text as it comes;
- ``await s.select("name", choices)`` scores every choice in one decode
  (``prefill_tree``) and appends the most likely;
- ``forks = await s.fork(n)`` makes KV forks (the prefix is shared, not
  copied); generations of forks under ``asyncio.gather`` share one decode
  per step; ``await s.join(forks)`` frees them.

``@lloyal.program`` makes it a :class:`Program`: ``await prog.run(ctx,
...)``, ``await prog.run_batch(ctx, inputs, concurrency=)``. docs/program.md
has it beside SGLang's frontend.
"""

from lloyal.programs._roles import Turn, assistant, system, user
from lloyal.programs._run import Program, program, run_batch
from lloyal.programs._select import choice_logprobs
from lloyal.programs._state import ProgramState

__all__ = [
    "Program",
    "ProgramState",
    "Turn",
    "assistant",
    "choice_logprobs",
    "program",
    "run_batch",
    "system",
    "user",
]
