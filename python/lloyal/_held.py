"""What a branch holds, as bytes: the one conversation model that
:class:`lloyal.Session` and a program's state both sync their branch by.

:class:`Held` knows the bytes each of a branch's tokens stands for. Given
the text the branch should hold next, :meth:`Held.sync` keeps the longest
prefix it holds already (cut at a token boundary), truncates the rest and
decodes what is new: a text that only grows costs its new tokens; one that
changes earlier text (a chat template that rewrites an old turn) costs a
re-decode from the first changed token, never a wrong cache. Media stand
in the bytes as a key of their digest between 0xFF bytes (never in UTF-8
text, so text cannot pose as a medium), so they are
compared by content and a cut never falls inside one.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lloyal.media import MEDIA_MARKER, Media

if TYPE_CHECKING:
    from lloyal.branch import Branch
    from lloyal.chat.prompt import ChatPrompt
    from lloyal.context import Context

__all__ = ["Held", "upgrade", "with_keys"]

# A medium in the held bytes: its digest between 0xFF bytes, which no UTF-8
# text holds, so no text can name a medium (a NUL could be in a message).
_KEY = re.compile(rb"\xff([0-9a-f]{64})\xff")
_OLD_KEY = re.compile(rb"\x00([0-9a-f]{64})\x00")


class Held:
    """The bytes a branch's tokens stand for (``data``) and the byte
    offset each token ends at (``ends``), after ``base`` tokens whose bytes
    are not known (a branch the state was opened on); those are never cut.
    """

    __slots__ = ("base", "data", "ends")

    def __init__(self, data: bytes = b"", ends: Sequence[int] = (), base: int = 0) -> None:
        self.data = data
        self.ends = list(ends)
        self.base = base

    def copy(self) -> Held:
        return Held(self.data, self.ends, self.base)

    @property
    def tokens(self) -> int:
        """The tokens the branch holds (``base`` included)."""
        return self.base + len(self.ends)

    @property
    def text(self) -> str:
        """The held text, a :data:`~lloyal.MEDIA_MARKER` for each medium."""
        return _KEY.sub(MEDIA_MARKER.encode(), self.data).decode("utf-8", errors="replace")

    def extend(self, pieces: Sequence[bytes]) -> None:
        """Tokens decoded into the branch, by their bytes."""
        at = len(self.data)
        for piece in pieces:
            at += len(piece)
            self.ends.append(at)
        self.data += b"".join(pieces)

    def cut(self, tokens: int) -> None:
        """Forget everything after the first ``tokens`` tokens (``base``
        included): the branch was truncated there."""
        keep = max(0, tokens - self.base)
        if keep < len(self.ends):
            self.data = self.data[: self.ends[keep - 1] if keep else 0]
            del self.ends[keep:]

    async def sync(
        self,
        ctx: Context,
        branch: Branch,
        want: bytes,
        media: Mapping[str, Media] | None = None,
        *,
        first: Sequence[int] = (),
    ) -> int:
        """Make ``branch`` hold exactly ``want``; the number of tokens
        decoded. ``first``: tokens already chosen for what follows the held
        bytes (a generation's last token, not decoded yet), decoded as
        they are when ``want`` goes on with their bytes."""
        media = media or {}
        if first:
            pieces = [ctx.token_bytes(t, render_special=True) for t in first]
            joined = self.data + b"".join(pieces)
            if want.startswith(joined):
                more, more_ends = await self._pieces(ctx, want[len(joined) :], media, len(joined))
                await branch.prefill([*first, *more])
                self.extend(pieces)
                self.ends += more_ends
                self.data = want
                return len(first) + len(more)
        if want == self.data:
            return 0
        # Tokens wholly inside the common prefix stay.
        keep = bisect.bisect_right(self.ends, _common_prefix(self.data, want))
        if keep > 0 and self.ends[keep - 1] == len(want):
            keep -= 1  # nothing left to decode: redo the last token for its logits
        # The cut must fall on a character boundary (and not inside a
        # medium's run) to tokenize the rest.
        while keep > 0 and (
            not _char_boundary(want, self.ends[keep - 1])
            or (keep < len(self.ends) and self.ends[keep] == self.ends[keep - 1])
        ):
            keep -= 1
        start = self.ends[keep - 1] if keep else 0
        tokens, ends = await self._pieces(ctx, want[start:], media, start)
        if keep < len(self.ends):
            await branch.truncate(self.base + keep)
            self.cut(self.base + keep)
        if tokens:
            await branch.prefill(tokens)
        self.data = want
        self.ends += ends
        return len(tokens)

    async def _pieces(
        self, ctx: Context, data: bytes, media: Mapping[str, Media], at: int
    ) -> tuple[list[int], list[int]]:
        """Tokens for ``data`` (placed at byte ``at``) and where each ends."""
        tokens: list[int] = []
        ends: list[int] = []
        for i, piece in enumerate(_KEY.split(data)):
            if i % 2:  # a medium's digest
                run = await ctx._media.placeholders(media[piece.decode()])
                at += len(piece) + 2
                tokens += run
                ends += [at] * len(run)
            elif piece:
                first = self.base == 0 and at == 0
                more, more_ends = _tokenize(ctx, piece.decode(), first=first, base=at)
                tokens += more
                ends += more_ends
                at += len(piece)
        return tokens, ends


def _tokenize(ctx: Context, text: str, *, first: bool, base: int) -> tuple[list[int], list[int]]:
    """Tokens of ``text`` and the byte offset each ends at. Tokens whose
    bytes do not add up to the text (a normalising tokenizer) are treated
    as one unit, so no cut ever falls inside them."""
    tokens = ctx.tokenize_sync(text, add_special=bool(first))
    pieces = [ctx.token_bytes(t, render_special=True) for t in tokens]
    data = text.encode()
    if first and tokens and ctx.bos_token is not None and tokens[0] == ctx.bos_token:
        if not data.startswith(pieces[0]):
            pieces[0] = b""  # the tokenizer added BOS; the text has none
        elif len(tokens) > 1 and tokens[1] == tokens[0]:
            tokens, pieces = tokens[1:], pieces[1:]  # the template wrote BOS too
    ends, at = [], base
    for piece in pieces:
        at += len(piece)
        ends.append(at)
    if b"".join(pieces) != data:
        ends = [base + len(data)] * len(tokens)
    return tokens, ends


def upgrade(held: bytes) -> bytes:
    """Held bytes saved before media keys were 0xFF-delimited (sessions
    saved with format 2) in today's form."""
    return _OLD_KEY.sub(rb"\xff\1\xff", held)


def with_keys(chat: ChatPrompt) -> tuple[bytes, dict[str, Media]]:
    """The prompt's bytes with each media marker replaced by its medium's
    key, and the media by digest."""
    pieces = chat.prompt.split(MEDIA_MARKER)
    out = [pieces[0].encode()]
    for medium, piece in zip(chat.media, pieces[1:], strict=True):
        out.append(b"\xff" + medium.digest.encode() + b"\xff")
        out.append(piece.encode())
    return b"".join(out), {m.digest: m for m in chat.media}


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:  # the first differing byte, by halving
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _char_boundary(data: bytes, at: int) -> bool:
    return at >= len(data) or (data[at] & 0xC0) != 0x80
