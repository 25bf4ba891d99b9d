"""Multi-turn streaming chat on one live branch (see README.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from typing import Any

import anyio
import lloyal
from lloyal.models import default_model_path


async def read_line(interactive: bool) -> str | None:
    if interactive:
        print("\nyou> ", end="", flush=True)
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    return line.rstrip("\n") if line else None


async def chat(
    model: str | None, template: str | None, system: str | None, max_tokens: int
) -> None:
    interactive = sys.stdin.isatty()
    async with await lloyal.create_context(model or default_model_path(), n_ctx=4096) as ctx:
        params = lloyal.SamplingParams(temperature=0.7, repeat_penalty=1.1, seed=0)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        rendered = ""  # what the branch holds, as the template renders it
        branch = lloyal.Branch.create(ctx, params=params)
        async with branch:
            while (line := await read_line(interactive)) is not None:
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line})
                prompt = ctx.format_chat(messages, template=template)
                # Only the new user turn is decoded: the branch already holds
                # everything before it (closed with the turn separator).
                if not prompt.prompt.startswith(rendered):
                    raise RuntimeError("the template re-renders earlier turns; cannot append")
                new = await ctx.tokenize(prompt.prompt[len(rendered) :], add_special=not rendered)
                await branch.prefill(new)
                started, stream, reply = time.perf_counter(), lloyal.TextStream(ctx), []
                print("bot> ", end="", flush=True)
                for _ in range(max_tokens):
                    p = await branch.produce()
                    if p.is_stop or p.token in prompt.stop_tokens:
                        break
                    await branch.commit(p.token)
                    reply.append(stream.push(p.token))
                    print(reply[-1], end="", flush=True)
                reply.append(stream.flush())
                print(reply.pop(), flush=True)
                elapsed = time.perf_counter() - started
                # Close the assistant turn the way the template does, so the
                # next user turn can be appended to the same KV.
                await branch.prefill(ctx.turn_separator)
                messages.append({"role": "assistant", "content": "".join(reply)})
                rendered = ctx.format_chat(
                    messages, template=template, add_generation_prompt=False
                ).prompt
                print(
                    f"[{len(new)} prompt tokens decoded, {len(reply)} generated in {elapsed:.1f}s, "
                    f"{branch.position} tokens in context]",
                    file=sys.stderr,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model")
    parser.add_argument("--template", help="chat template name or Jinja (default: the model's)")
    parser.add_argument("--system", help="system message")
    parser.add_argument("--max-tokens", type=int, default=256, help="per reply")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(chat(args.model, args.template, args.system, args.max_tokens))


if __name__ == "__main__":
    main()
