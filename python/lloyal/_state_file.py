"""The prefix cache's state files: one decoded prompt's branch state on
disk, checked whole before llama.cpp sees a byte of it.

A file is a header (magic, format version, token count, state length), the
tokens, a checksum of those (enough to index a folder without reading the
states), the branch state, and a checksum of everything before it (checked
when restoring). Files are written beside their name and renamed over it,
so a reader never sees half a file; they are opened only when regular
files (never through a symlink, never waiting on a FIFO).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import BinaryIO

from lloyal.errors import StateError

# A state file: _HEAD (magic, format version, token count, state bytes),
# the tokens, a checksum of all that (checked when indexing), the branch
# state, and a checksum of everything before it (checked when restoring).
_HEAD = struct.Struct("<8sIIQ")
_MAGIC = b"LLOYALPC"
_VERSION = 2
_DIGEST = 32
# Never through a symlink, never waiting on a FIFO (flags an OS lacks are 0).
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_BINARY", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOCTTY", 0)
)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for part in parts:
        h.update(part)
    return h.digest()


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file itself;
    ``OSError`` otherwise (the check is on what was opened: no race).
    Where ``open`` cannot refuse a link (Windows has no ``O_NOFOLLOW``),
    the file opened must be the very file ``lstat`` saw as a regular one
    (same volume and file id), so a link swapped in between is refused."""
    seen = None if hasattr(os, "O_NOFOLLOW") else os.lstat(path)
    if seen is not None and not stat.S_ISREG(seen.st_mode):
        raise OSError(f"{path} is not a regular file")
    fd = os.open(path, _OPEN_FLAGS)
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise OSError(f"{path} is not a regular file")
        if seen is not None and (seen.st_dev, seen.st_ino) != (opened.st_dev, opened.st_ino):
            raise OSError(f"{path} changed while it was opened")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_head(f: BinaryIO, size: int) -> tuple[tuple[int, ...], bytes]:
    """The tokens of a state file of ``size`` bytes, and the bytes up to
    its state, read only once the lengths they give add up to ``size``;
    ``StateError`` for another format or a damaged header."""
    fixed = f.read(_HEAD.size)
    if len(fixed) != _HEAD.size:
        raise StateError("not a prefix-cache state file")
    magic, version, n, n_state = _HEAD.unpack(fixed)
    if magic != _MAGIC or version != _VERSION or n == 0:
        raise StateError("not a prefix-cache state file of this version")
    if size != _HEAD.size + 4 * n + _DIGEST + n_state + _DIGEST:
        raise StateError("the state file's lengths do not add up to its size")
    rest = f.read(4 * n + _DIGEST)
    head = fixed + rest[: 4 * n]
    if len(rest) != 4 * n + _DIGEST or _digest(head) != rest[4 * n :]:
        raise StateError("the state file's header is damaged")
    return struct.unpack(f"<{n}I", rest[: 4 * n]), fixed + rest


def read_state(path: Path, tokens: tuple[int, ...]) -> bytes:
    """The branch state in ``path``, if the whole file is intact and
    holds ``tokens``; ``StateError`` otherwise."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        held, head = read_head(f, size)
        state = f.read(size - len(head) - _DIGEST)
        digest = f.read(_DIGEST + 1)
    if digest != _digest(head, state):
        raise StateError("the state file is damaged")
    if held != tokens:
        raise StateError("the state file holds another prompt")
    return state


def write_state(path: Path, tokens: tuple[int, ...], state: bytes) -> None:
    """Write a state file whole or not at all: into a file beside it
    (not a ``*.state``), renamed over it once complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = _HEAD.pack(_MAGIC, _VERSION, len(tokens), len(state))
    head += struct.pack(f"<{len(tokens)}I", *tokens)
    head += _digest(head)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "xb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            f.write(head)
            f.write(state)
            f.write(_digest(head, state))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
