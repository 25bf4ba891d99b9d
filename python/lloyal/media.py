"""Images and audio in a branch (llama.cpp's libmtmd).

Load a projector (the ``mmproj`` GGUF published beside a vision or audio
model) with ``create_context(model, mmproj=path)`` or
:meth:`Context.load_projector <lloyal.Context.load_projector>`. A medium
is then part of a prompt like text: :meth:`Context.tokenize
<lloyal.Context.tokenize>` with ``media=`` turns text holding
:data:`MEDIA_MARKER` into tokens where each medium is a run of
placeholder ids (negative, one per position it takes), and
:meth:`Branch.prefill <lloyal.Branch.prefill>` encodes each medium and
decodes it into the branch's KV at its place. Forks made after it share
its cells (no second encode); the prefix cache matches media by content,
since the same picture (its decoded pixels, whatever the file format) always
gets the same placeholders in a context.

Chat messages take media as content parts (:meth:`Context.format_chat
<lloyal.Context.format_chat>` puts a marker where each goes and keeps the
media in :attr:`ChatPrompt.media <lloyal.ChatPrompt.media>`): OpenAI's
``{"type": "image_url", "image_url": {"url": "data:..."}}`` and
``{"type": "input_audio", "input_audio": {"data": ..., "format": "wav"}}``,
or ``{"type": "image", "image": x}`` / ``{"type": "audio", "audio": x}``
with ``x`` anything :meth:`Media.coerce` takes.

>>> import asyncio, lloyal
>>> import numpy as np
>>> from lloyal import fixtures
>>> async def main():
...     ctx = await lloyal.create_context(MODEL, n_seq_max=4, mmproj=fixtures.mmproj())
...     async with ctx:
...         picture = lloyal.Media.from_array(np.full((16, 16, 3), 200, np.uint8))
...         tokens = await ctx.tokenize(
...             f"Look: {lloyal.MEDIA_MARKER} What is it?", media=[picture]
...         )
...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
...         await b.prefill(tokens)
...         forks = [await b.fork() for _ in range(3)]
...         return ctx.projector.vision, b.position == len(tokens), len(forks)
>>> asyncio.run(main())
(True, True, 3)

Bad media (corrupt, truncated, larger than 8192 pixels a side, a format
libmtmd does not read, audio for a projector without an audio encoder)
raises :class:`MediaError <lloyal.MediaError>` and changes nothing; a
projector for another model raises :class:`ProjectorLoadError
<lloyal.ProjectorLoadError>`. docs/multimodal.md has the details.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from lloyal import _lloyal
from lloyal._bridge import call_native
from lloyal.errors import MediaError

__all__ = ["MEDIA_MARKER", "Media", "ProjectorInfo"]

MEDIA_MARKER: str = _lloyal.NativeContext.media_marker()
"""The text that stands for one medium in a prompt (``"<__media__>"``)."""

# The bytes of media a context keeps for prefills of their placeholders,
# the least recently tokenized let go first (their ids are not reused).
_KEEP_BYTES = 256 << 20


@dataclass(frozen=True)
class ProjectorInfo:
    """What a loaded projector takes (:attr:`Context.projector
    <lloyal.Context.projector>`)."""

    vision: bool
    audio: bool
    audio_sample_rate: int | None = None


def _audio_magic(data: bytes) -> bool:
    return (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
        or data[:4] == b"fLaC"
        or data[:3] == b"ID3"
        or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
    )


_IMAGE_TYPES = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"BM", "image/bmp"),
)


@dataclass(frozen=True, eq=False)
class Media:
    """One image or audio clip: an encoded file (PNG, JPEG, BMP, GIF, TGA;
    WAV, MP3, FLAC), or raw RGB pixels with their ``size`` ``(width,
    height)``. Two media are equal when their bytes are.

    >>> import lloyal, numpy as np
    >>> a = lloyal.Media.from_array(np.zeros((2, 3, 3), np.uint8))
    >>> a.size, a.kind, a == lloyal.Media(bytes(18), size=(3, 2))
    ((3, 2), 'image', True)
    """

    data: bytes
    size: tuple[int, int] | None = None
    digest: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes):
            object.__setattr__(self, "data", bytes(self.data))
        digest = hashlib.sha256(self.data)
        if self.size is not None:
            width, height = self.size
            if not all(isinstance(v, int) and v > 0 for v in (width, height)):
                raise MediaError(f"size must be two positive ints, got {self.size!r}")
            if len(self.data) != width * height * 3:
                raise MediaError(
                    f"RGB pixels of {width}x{height} are {width * height * 3} bytes, "
                    f"got {len(self.data)}"
                )
            digest.update(b"rgb%dx%d" % self.size)
        object.__setattr__(self, "digest", digest.hexdigest())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Media) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        size = f", size={self.size}" if self.size else ""
        return f"Media({self.kind}, {len(self.data)} bytes{size}, digest={self.digest[:12]})"

    @property
    def kind(self) -> str:
        """``"audio"`` or ``"image"``, from the data's first bytes (libmtmd
        tells them apart the same way)."""
        return "audio" if self.size is None and _audio_magic(self.data) else "image"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Media:
        """The bytes of a file."""
        return cls(Path(path).read_bytes())

    @classmethod
    def from_base64(cls, data: str | bytes) -> Media:
        """Base64 text (OpenAI's ``input_audio.data``)."""
        try:
            return cls(base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            raise MediaError("the media is not valid base64") from None

    @classmethod
    def from_data_url(cls, url: str) -> Media:
        """A ``data:`` URL (``data:image/png;base64,...``)."""
        if not isinstance(url, str) or not url.startswith("data:") or "," not in url:
            raise MediaError("expected a data: URL (data:<type>;base64,<data>)")
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise MediaError("only base64 data: URLs are read")
        return cls.from_base64(payload)

    @classmethod
    def from_array(cls, pixels: Any) -> Media:
        """RGB pixels: a ``(height, width, 3)`` uint8 array."""
        arr = np.asarray(pixels)
        if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
            raise MediaError(
                f"pixels must be a (height, width, 3) uint8 array, got {arr.shape} {arr.dtype}"
            )
        return cls(np.ascontiguousarray(arr).tobytes(), size=(arr.shape[1], arr.shape[0]))

    def to_part(self) -> dict[str, Any]:
        """A chat content part holding this medium that JSON can carry:
        ``image_url`` with a ``data:`` URL, ``input_audio``, or for raw
        pixels ``{"type": "image", "image": {"rgb": base64, "size": [w, h]}}``."""
        b64 = base64.b64encode(self.data).decode()
        if self.size is not None:
            return {"type": "image", "image": {"rgb": b64, "size": list(self.size)}}
        if self.kind == "audio":
            fmt = (
                "wav" if self.data[:4] == b"RIFF" else "flac" if self.data[:4] == b"fLaC" else "mp3"
            )
            return {"type": "input_audio", "input_audio": {"data": b64, "format": fmt}}
        mime = next(
            (m for magic, m in _IMAGE_TYPES if self.data.startswith(magic)),
            "application/octet-stream",
        )
        return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}}

    @classmethod
    def coerce(cls, value: Any) -> Media:
        """``value`` as a medium: a ``Media``; ``bytes``; a ``data:`` URL;
        a path (``str`` or ``os.PathLike``); an RGB array; the
        ``{"rgb": base64, "size": [w, h]}`` of :meth:`to_part`."""
        if isinstance(value, Media):
            return value
        if isinstance(value, Mapping) and "rgb" in value:
            size = value.get("size")
            if not (isinstance(size, (list, tuple)) and len(size) == 2):
                raise MediaError('raw pixels need "size": [width, height]')
            pixels = cls.from_base64(value["rgb"]).data
            return cls(pixels, size=(size[0], size[1]))
        if isinstance(value, (bytes, bytearray, memoryview)):
            return cls(bytes(value))
        if isinstance(value, str) and value.startswith("data:"):
            return cls.from_data_url(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_file(value)
        if isinstance(value, np.ndarray):
            return cls.from_array(value)
        raise TypeError(
            f"a medium is Media, bytes, a data: URL, a path or an RGB array, "
            f"not {type(value).__name__}"
        )


def media_part(part: Mapping[str, Any]) -> Media | None:
    """The medium of a chat content part, or ``None`` for a text part."""
    kind = part.get("type")
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, Mapping) else spec
        if not isinstance(url, str):
            raise TypeError('an image_url part needs {"image_url": {"url": ...}}')
        return Media.coerce(url)
    if kind == "input_audio":
        spec = part.get("input_audio")
        data = spec.get("data") if isinstance(spec, Mapping) else None
        if not isinstance(data, str):
            raise TypeError('an input_audio part needs {"input_audio": {"data": base64}}')
        return Media.from_base64(data)
    if kind in ("image", "audio"):
        return Media.coerce(part.get(kind))
    return None


def portable_content(content: Any) -> Any:
    """A message's content with every medium as :meth:`Media.to_part`
    (what a saved session keeps); text is left as it is."""
    if not isinstance(content, list):
        return content
    out = []
    for p in content:
        medium = media_part(p) if isinstance(p, Mapping) else None
        out.append(p if medium is None else medium.to_part())
    return out


def flatten_media(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[Mapping[str, Any]], list[Media]]:
    """Messages whose content parts hold media, rewritten with their text
    and a :data:`MEDIA_MARKER` for each medium, and the media in order.
    Messages without media are passed through as they are."""
    out: list[Mapping[str, Any]] = []
    media: list[Media] = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list) or not any(
            isinstance(p, Mapping) and p.get("type") != "text" for p in content
        ):
            out.append(m)
            continue
        text = []
        for p in content:
            if not isinstance(p, Mapping):
                raise TypeError("content parts must be dicts")
            medium = media_part(p)
            if medium is None:
                if not isinstance(p.get("text"), str):
                    raise TypeError(f"unknown content part type {p.get('type')!r}")
                if MEDIA_MARKER in p["text"]:
                    raise ValueError(f"text parts must not hold the media marker {MEDIA_MARKER}")
                text.append(p["text"])
            else:
                media.append(medium)
                text.append(MEDIA_MARKER)
        out.append({**m, "content": "".join(text)})
    return out, media


class MediaTable:
    """A context's media placeholders: the same picture or clip (its
    decoded pixels or samples, whatever the file format) always gets the
    same id under one projector, so the prefix cache matches it by
    content. The bytes of the most recently tokenized media, up to
    :data:`_KEEP_BYTES`, are kept for prefills. Ids are never given out
    twice: a projector swap (:meth:`reset`) starts new ones, so tokens made
    under the old projector are refused, not decoded at the wrong
    positions."""

    def __init__(self, native: _lloyal.NativeContext) -> None:
        self._native = native
        self._next = -1  # the next new id
        self._first = -1  # the first id under the loaded projector
        # The bytes' digest -> (placeholder, positions); a decoded content
        # hash -> placeholder (the same picture as PNG or raw pixels).
        self._ids: dict[str, tuple[int, int]] = {}
        self._by_content: dict[int, int] = {}
        self._positions: dict[int, int] = {}  # placeholder -> positions
        self._media: OrderedDict[int, Media] = OrderedDict()
        self._bytes = 0

    def reset(self) -> None:
        """Forget every medium: another projector is loaded (a medium's
        positions and encoding are the projector's)."""
        self._ids.clear()
        self._by_content.clear()
        self._positions.clear()
        self._media.clear()
        self._bytes = 0
        self._first = self._next

    async def placeholders(self, medium: Media) -> list[int]:
        """The run of ids that stands for ``medium`` (one per position)."""
        known = self._ids.get(medium.digest)
        if known is None:
            n, content = await call_native(
                lambda done: self._native.media_positions(medium.data, medium.size, done)
            )
            placeholder = self._by_content.get(content)
            if placeholder is None:
                placeholder = self._by_content[content] = self._next
                self._next -= 1
            known = (placeholder, int(n))
            self._ids[medium.digest] = known
            self._positions[placeholder] = known[1]
        if known[0] not in self._media:
            self._bytes += len(medium.data)
        self._media[known[0]] = medium
        self._media.move_to_end(known[0])
        while self._bytes > _KEEP_BYTES and len(self._media) > 1:
            _, dropped = self._media.popitem(last=False)
            self._bytes -= len(dropped.data)
        return [known[0]] * known[1]

    def check_held(self, ids: Sequence[int]) -> None:
        """Raise if a medium of ``ids`` (just tokenized) is let go already:
        its prompt's media alone pass :data:`_KEEP_BYTES`."""
        for t in set(ids):
            if t < 0 and t not in self._media:
                raise MediaError(
                    f"the prompt's media take more than the {_KEEP_BYTES >> 20} MiB "
                    "of media a context keeps for a prefill"
                )

    def split(self, ids: Sequence[int]) -> list[list[int] | Media]:
        """``ids`` as runs of tokens and media, checked before anything is
        decoded: every placeholder run is whole and its medium known."""
        parts: list[list[int] | Media] = []
        i = 0
        while i < len(ids):
            t = ids[i]
            if t >= 0:
                j = i
                while j < len(ids) and ids[j] >= 0:
                    j += 1
                parts.append(list(ids[i:j]))
                i = j
                continue
            medium = self._media.get(t)
            n = self._positions.get(t)
            if medium is None or n is None:
                self._refuse_unknown(t)
            if ids[i : i + n] != [t] * n:
                raise ValueError(f"a medium's placeholders are cut (id {t} needs a run of {n})")
            parts.append(medium)
            i += n
        return parts

    def _refuse_unknown(self, t: int) -> NoReturn:
        again = "tokenize the prompt again with media="
        if t > self._first:
            raise MediaError(
                f"placeholder id {t} was made under a projector loaded before the one "
                f"now loaded: {again}"
            )
        if t in self._positions:
            raise MediaError(
                f"placeholder id {t} stands for a medium this context let go (it keeps "
                f"the last {_KEEP_BYTES >> 20} MiB of media): {again}"
            )
        raise ValueError(f"placeholder id {t} stands for no medium this context holds: {again}")


def has_media(tokens: Sequence[int]) -> bool:
    """Whether ``tokens`` hold media placeholders (negative ids): what a
    draft model, a context shift or ``logits="all"`` cannot take.

    >>> from lloyal.media import has_media
    >>> has_media([1, 2, 3]), has_media([1, -1, -1, 2])
    (False, True)
    """
    return any(t < 0 for t in tokens)


def whole_media_prefix(ids: Sequence[int], n: int) -> int:
    """The largest ``m <= n`` that does not cut a medium's run of
    placeholders in ``ids`` (a prefix cache's reuse point)."""
    while 0 < n < len(ids) and ids[n] < 0 and ids[n - 1] == ids[n]:
        n -= 1
    return n
