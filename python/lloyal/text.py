"""Turning streamed tokens into text without splitting characters."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lloyal.context import Context


class TextStream:
    """Incremental detokenizer for streaming output.

    A token can end in the middle of a multi-byte UTF-8 character (emoji,
    CJK); ``push`` holds such bytes back until the character is complete, so
    the pieces it returns always join to the full text.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         stream = lloyal.TextStream(ctx)
    ...         tokens = await ctx.tokenize("café ☕", add_special=False)
    ...         return "".join(stream.push(t) for t in tokens) + stream.flush()
    >>> asyncio.run(main())
    'café ☕'
    """

    def __init__(self, ctx: Context, *, render_special: bool = False) -> None:
        self._ctx = ctx
        self._render_special = render_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly empty)."""
        return self._decoder.decode(
            self._ctx.token_bytes(token, render_special=self._render_special)
        )

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
