"""Fill-in-the-middle prompts: the code before and after a cursor, laid
out with the model's FIM tokens so that what it writes next is the middle.

The layout is the prefix-suffix-middle one code models are trained on:
``[BOS] [extra files] <prefix-token> prefix <suffix-token> suffix
<middle-token> middle``, where ``middle`` is text already written at the
cursor (usually empty). Extra files (other files of the project, for
context) go first, each as ``<file-sep-token> name\\n text``, after
``<repo-token> name\\n`` when the model has those tokens, as plain text
otherwise. Over a token ``budget``, the extra files go first (the earliest
first), then the prefix loses its start and the suffix its end, so that
what is next to the cursor stays: the prefix keeps up to three quarters of
what is left, the suffix the rest.

>>> import asyncio, lloyal
>>> from lloyal import fixtures
>>> from lloyal.infill import fim_prompt
>>> async def main():
...     async with await lloyal.create_context(fixtures.fim_model()) as ctx:
...         ids = await fim_prompt(ctx, "def add(a, b):\\n    return ", "\\n\\nprint(add(1, 2))\\n")
...         fim = ctx.fim_tokens
...         return [ids.index(t) < ids.index(u) for t, u in
...                 [(fim.prefix, fim.suffix), (fim.suffix, fim.middle)]], ids[-1] == fim.middle
>>> asyncio.run(main())
([True, True], True)
"""

from __future__ import annotations

from collections.abc import Sequence

from lloyal.context import Context


class NoFimError(ValueError):
    """The model has no fill-in-the-middle tokens."""


async def fim_prompt(
    ctx: Context,
    prefix: str,
    suffix: str,
    *,
    middle: str = "",
    files: Sequence[tuple[str, str]] = (),
    repo: str | None = None,
    budget: int | None = None,
) -> list[int]:
    """The tokens of a fill-in-the-middle prompt (see the module docs):
    ``files`` are ``(name, text)`` pairs of extra context, ``repo`` the
    project's name, ``budget`` the most tokens the prompt may have (None:
    no limit). Raises :class:`NoFimError` (a ``ValueError``) when the model
    has no prefix, suffix and middle tokens, and ``ValueError`` when the
    budget cannot hold the FIM tokens and ``middle``."""
    fim = ctx.fim_tokens
    if fim.prefix is None or fim.suffix is None or fim.middle is None:
        raise NoFimError(
            "this model has no fill-in-the-middle tokens (prefix, suffix and middle); "
            "use a code model trained for infill"
        )
    # What tokenizing adds for this model (BOS, for most).
    bos = await ctx.tokenize("", add_special=True)
    pre = await ctx.tokenize(prefix, add_special=False) if prefix else []
    suf = await ctx.tokenize(suffix, add_special=False) if suffix else []
    mid = await ctx.tokenize(middle, add_special=False) if middle else []
    extra = await _extra(ctx, files, repo)
    fixed = len(bos) + 3 + len(mid)
    if budget is not None:
        room = budget - fixed
        if room < 0:
            raise ValueError(f"a budget of {budget} tokens cannot hold the FIM tokens and middle")
        while extra and sum(map(len, extra)) + min(len(pre) + len(suf), room) > room:
            extra.pop(0)
        room -= sum(map(len, extra))
        keep_pre = min(len(pre), max(room * 3 // 4, room - len(suf)))
        keep_suf = min(len(suf), room - keep_pre)
        pre, suf = pre[len(pre) - keep_pre :], suf[:keep_suf]
    flat = [t for chunk in extra for t in chunk]
    return [*bos, *flat, fim.prefix, *pre, fim.suffix, *suf, fim.middle, *mid]


async def _extra(
    ctx: Context, files: Sequence[tuple[str, str]], repo: str | None
) -> list[list[int]]:
    """Each extra file's tokens (the first chunk also names the repo)."""
    fim = ctx.fim_tokens
    chunks: list[list[int]] = []
    for name, text in files:
        if fim.file_sep is not None:
            body = await ctx.tokenize(f"{name}\n{text}", add_special=False)
            chunks.append([fim.file_sep, *body])
        else:
            chunks.append(await ctx.tokenize(f"# {name}\n{text}\n", add_special=False))
    if chunks and repo is not None and fim.repo is not None:
        chunks[0] = [fim.repo, *await ctx.tokenize(f"{repo}\n", add_special=False), *chunks[0]]
    return chunks
