"""One completions request's prompt and choices as they grow (shared by
``/v1/completions`` and llama-server's ``/infill``), and OpenAI's usage."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from lloyal.grammar import Grammar
from lloyal.infill import NoFimError, fim_prompt
from lloyal.server._engine import ChoiceEvent
from lloyal.server._protocol import ApiError, CompletionRequest
from lloyal.server._state import State


def usage_body(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage: ``cached_tokens`` are the prompt tokens the prefix
    cache gave (not decoded for this request)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class CompletionRun:
    """One prompt's choices of a completions request, as they grow."""

    def __init__(
        self, state: State, req: CompletionRequest, offset: int, *, grammar: Grammar | None = None
    ) -> None:
        self.state, self.req, self.gen, self.offset = state, req, req.generation, offset
        self.grammar = grammar
        n = self.gen.n
        self.texts = [""] * n
        self.counts = [0] * n
        self.lps: list[dict[str, list[Any]]] = [
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for _ in range(n)
        ]
        self.tokens: list[int] = []
        self.prompt_text = ""
        self.cached = 0

    async def prepare(self, prompt: str | list[int]) -> None:
        ctx = self.state.ctx
        if self.req.suffix is not None:
            assert isinstance(prompt, str)  # (the request was checked)
            await self.prepare_fim(prompt, self.req.suffix, param="suffix")
        elif isinstance(prompt, str):
            self.tokens, self.prompt_text = await ctx.tokenize(prompt), prompt
        else:
            self.tokens, self.prompt_text = prompt, await ctx.detokenize(prompt)

    async def prepare_fim(
        self,
        prefix: str,
        suffix: str,
        *,
        middle: str = "",
        files: tuple[tuple[str, str], ...] = (),
        param: str = "input_suffix",
    ) -> None:
        """A fill-in-the-middle prompt (:func:`lloyal.infill.fim_prompt`),
        cut to leave room for the reply: ``max_tokens``, or a quarter of
        the context when it asks for none."""
        ctx = self.state.ctx
        reply = min(self.gen.max_tokens or ctx.n_ctx // 4, ctx.n_ctx // 2)
        try:
            self.tokens = await fim_prompt(
                ctx, prefix, suffix, middle=middle, files=files, budget=ctx.n_ctx - reply
            )
        except NoFimError as e:
            raise ApiError(str(e), param=param) from None
        self.prompt_text = prefix

    def record(self, event: ChoiceEvent) -> None:
        i = event.index
        if event.cached is not None:
            self.cached = event.cached
        if event.token is not None:
            self.counts[i] += 1
            if event.logprob is not None:
                ctx, lp = self.state.ctx, self.lps[i]
                echoed = len(self.prompt_text) if self.req.echo else 0
                lp["text_offset"].append(echoed + len(self.texts[i]))
                lp["tokens"].append(ctx.token_to_text(event.token))
                lp["token_logprobs"].append(event.logprob)
                lp["top_logprobs"].append({ctx.token_to_text(t): v for t, v in event.top})
        self.texts[i] += event.text

    def usage(self) -> dict[str, Any]:
        return usage_body(len(self.tokens), sum(self.counts), self.cached)

    async def events(self) -> AsyncGenerator[ChoiceEvent, None]:
        engine = self.state.engine
        async with engine.admitted(self.tokens, self.gen):
            async for event in engine.generate(self.tokens, self.gen, grammar=self.grammar):
                self.record(event)
                yield event

    async def choices(self) -> list[dict[str, Any]]:
        """Run to the end: the choices, numbered from ``offset``."""
        finishes: dict[int, str] = {}
        async for event in self.events():
            if event.finish is not None:
                finishes[event.index] = event.finish
        return [
            {
                "index": self.offset + i,
                "text": (self.prompt_text if self.req.echo else "") + self.texts[i],
                "logprobs": self.lps[i] if self.gen.logprobs is not None else None,
                "finish_reason": finishes.get(i, "stop"),
            }
            for i in range(self.gen.n)
        ]
