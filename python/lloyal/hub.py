"""Models from the Hugging Face hub or a URL: ``lloyal pull`` and ``--model hf:...``.

:func:`resolve_model` turns what a user gives as a model into a file:

* a local path, returned as it is;
* ``hf:org/repo``: the repository's ``Q4_K_M`` file, else its first
  ``.gguf`` (projectors, ``mmproj*``, are skipped); ``hf:org/repo:Q8_0``:
  the file whose name has that tag (any case; the shortest name if several
  do); ``hf:org/repo/path/file.gguf``: that file. ``@REV`` after the
  repository names a branch, tag or commit (``hf:org/repo@v1.0:Q8_0``;
  default ``main``). A model split into ``-00001-of-0000N.gguf`` parts is
  pulled whole and its first part returned (llama.cpp finds the others);
* ``https://host/path/file.gguf``, with ``#sha256=<hex>`` to check it.

A download goes into a ``.part`` file beside its final name, which the next
try resumes with an HTTP Range request (a cut connection is retried at once
while bytes keep coming). The bytes are checked against the SHA-256 the hub
gives (the file's LFS object id, or the ``X-Linked-Etag`` of its redirect)
or the URL's fragment, and renamed into the cache only when they match; a
mismatch raises :class:`~lloyal.errors.ChecksumMismatchError` and keeps
nothing. The cache is :func:`lloyal.models.cache_dir` (``$LLOYAL_CACHE_DIR``):
``hub/ORG/REPO/REV/PATH`` and ``url/SHA256-OF-URL/NAME``, each file with a
``.pulled.json`` beside it (its size, SHA-256 and source). A file the cache
holds is returned without a request, so a pull of ``main`` is not refreshed
when the repository changes: name a commit, or delete the folder.

``$HF_ENDPOINT`` replaces https://huggingface.co; ``$HF_TOKEN`` is sent as
a bearer token to that host only (not to the CDN it redirects to).

>>> from lloyal.hub import resolve_model
>>> resolve_model(MODEL).name
'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from email.message import Message
from http.client import HTTPMessage
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, unquote, urldefrag, urljoin, urlsplit

from lloyal._lloyal import __version__
from lloyal.errors import ChecksumMismatchError, PullError, PullNotFoundError
from lloyal.models import cache_dir

DEFAULT_QUANT = "Q4_K_M"
DEFAULT_REVISION = "main"

_HF_SPEC = re.compile(
    r"hf:(?P<repo>\w[\w.-]*/\w[\w.-]*)(?:@(?P<rev>[^/:\s]+))?"
    r"(?::(?P<quant>[\w.-]+)|/(?P<path>.+))?"
)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_ATTEMPTS = 5  # tries of one file, while each cut try brought bytes
_MAX_REDIRECTS = 10
_TIMEOUT_S = 60.0
_REDIRECTS = (301, 302, 303, 307, 308)
_LINKED = ("X-Linked-Etag", "X-Linked-Size", "X-Repo-Commit")
_HEADERS = {"User-Agent": f"lloyal/{__version__}", "Accept-Encoding": "identity"}


def resolve_model(
    spec: str | os.PathLike[str], *, revision: str | None = None, progress: bool | None = None
) -> Path:
    """The local file for a model spec: a path as it is; ``hf:...`` or an
    ``http(s)://`` URL pulled into the cache (or found there) by :func:`pull`.

    >>> resolve_model("models/tiny.gguf").as_posix()
    'models/tiny.gguf'
    """
    if isinstance(spec, str) and _is_remote(spec):
        return pull(spec, revision=revision, progress=progress)
    if revision is not None:
        raise ValueError("a revision is for hf: models, not local paths")
    return Path(spec)


def pull(spec: str, *, revision: str | None = None, progress: bool | None = None) -> Path:
    """Download ``hf:org/repo[@rev][:QUANT]``, ``hf:org/repo[@rev]/path``
    or a URL into the cache, checked, and return its path; a verified file
    already there is returned without a request. ``progress``: one
    rewritten line on stderr (default: when stderr is a terminal).

    Raises :class:`~lloyal.errors.PullNotFoundError` (404, or no file
    matching the quantization), :class:`~lloyal.errors.ChecksumMismatchError`
    and :class:`~lloyal.errors.PullError` (the network, other HTTP errors).

    >>> pull("hf:bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0").name  # doctest: +SKIP
    'SmolLM2-135M-Instruct-Q8_0.gguf'
    """
    show = sys.stderr.isatty() if progress is None else progress
    if spec.startswith("hf:"):
        return _pull_hf(spec, revision, show)
    if revision is not None:
        raise ValueError("--revision is for hf: models, not URLs")
    if _is_remote(spec):
        return _pull_url(spec, show)
    raise ValueError(f"not a model to pull: {spec!r} (hf:org/repo[:QUANT] or an http(s) URL)")


def _is_remote(spec: str) -> bool:
    return spec.startswith(("hf:", "http://", "https://"))


# -- hf: specs ----------------------------------------------------------------


@dataclass(frozen=True)
class _Remote:
    """A file the repository's tree lists."""

    size: int | None
    sha256: str | None


def _pull_hf(spec: str, revision: str | None, show: bool) -> Path:
    found = _HF_SPEC.fullmatch(spec)
    if not found:
        raise ValueError(
            f"not a hub model: {spec!r}; expected hf:org/repo, hf:org/repo:QUANT "
            "or hf:org/repo/path/file.gguf (@REV after the repo for a revision)"
        )
    repo, quant, path = found["repo"], found["quant"], found["path"]
    if found["rev"] and revision and found["rev"] != revision:
        raise ValueError(f"{spec!r} names revision {found['rev']!r} but --revision is {revision!r}")
    rev = found["rev"] or revision or DEFAULT_REVISION
    if path is not None:
        path = _relative(path, spec, ValueError)
    base = cache_dir() / "hub" / repo / quote(rev, safe="")
    choices = base / ".choices.json"
    key = f"path:{path}" if path is not None else f"quant:{(quant or '').lower()}"
    chosen = _read_json(choices).get(key)
    if isinstance(chosen, list) and chosen and all(_cached(base / p) for p in chosen):
        return base / str(chosen[0])

    endpoint = _endpoint()
    tree: dict[str, _Remote] = {}
    if path is None:
        tree = _list_tree(endpoint, repo, rev)
        paths = _choose(tree, quant, f"{repo}@{rev}")
    else:
        paths = _split_parts(path, None, spec)
    for i, p in enumerate(paths):
        remote = tree.get(p, _Remote(None, None))
        label = p if len(paths) == 1 else f"{p} ({i + 1}/{len(paths)})"
        url = f"{endpoint}/{repo}/resolve/{quote(rev, safe='')}/{quote(p)}"
        _download(url, base / p, remote.sha256, remote.size, label, show)
    _write_json(choices, {**_read_json(choices), key: paths})
    return base / paths[0]


def _list_tree(endpoint: str, repo: str, rev: str) -> dict[str, _Remote]:
    """Every file of the repository at ``rev`` (the tree API, page by page)."""
    url: str | None = f"{endpoint}/api/models/{repo}/tree/{quote(rev, safe='')}?recursive=true"
    files: dict[str, _Remote] = {}
    while url is not None:
        response, _ = _open(url, {"Accept": "application/json"}, f"{repo}@{rev}")
        with response:
            try:
                entries = json.loads(response.read())
            except (ValueError, OSError) as e:
                raise PullError(f"{repo}@{rev}: unreadable file list from {url}") from e
            link = response.headers.get("Link", "")
        if not isinstance(entries, list):
            raise PullError(f"{repo}@{rev}: unexpected file list from {url}")
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("type", "file") != "file":
                continue
            lfs = entry.get("lfs")
            if not isinstance(lfs, dict):
                lfs = {}
            size = lfs.get("size", entry.get("size"))
            sha = lfs.get("oid")
            files[str(entry.get("path", ""))] = _Remote(
                size if isinstance(size, int) else None,
                sha.lower() if isinstance(sha, str) and _SHA256.fullmatch(sha.lower()) else None,
            )
        after = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', link)
        url = urljoin(url, after[1]) if after else None
    return files


def _choose(tree: Mapping[str, _Remote], quant: str | None, where: str) -> list[str]:
    """The files to pull for a quantization tag (all parts of a split model)."""
    ggufs = sorted(
        p
        for p in tree
        if p.lower().endswith(".gguf") and not p.rsplit("/", 1)[-1].lower().startswith("mmproj")
    )
    tag = (quant or DEFAULT_QUANT).lower()
    # The tag as a whole word first: Q4_K does not pick Q4_K_M over Q4_K.
    word = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])")
    matches = [p for p in ggufs if word.search(p.lower())] or [p for p in ggufs if tag in p.lower()]
    if not matches and quant is None:
        matches = ggufs
    if not matches:
        seen = ", ".join(ggufs) if ggufs else "none"
        raise PullNotFoundError(f"{where} has no .gguf file matching {quant!r}; it has: {seen}")
    first = min(matches, key=lambda p: (len(p), p))
    parts = _split_parts(first, tree, where)
    return [_relative(p, where, PullError) for p in parts]


def _split_parts(path: str, tree: Mapping[str, _Remote] | None, where: str) -> list[str]:
    """``path`` alone, or every part of the split model it is a part of."""
    split = _SPLIT.search(path)
    if not split:
        return [path]
    count = int(split[2])
    stem, suffix = path[: split.start()], path[split.end() - len(".gguf") :]
    parts = [f"{stem}-{i:05d}-of-{split[2]}{suffix}" for i in range(1, count + 1)]
    missing = [p for p in parts if tree is not None and p not in tree]
    if missing:
        raise PullNotFoundError(f"{where}: split model without its parts {', '.join(missing)}")
    return parts


def _relative(path: str, where: str, error: type[Exception]) -> str:
    """A repository path that stays inside its folder in the cache."""
    parts = path.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise error(f"{where}: not a file path in a repository: {path!r}")
    return path


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


# -- URLs -------------------------------------------------------------------------


def _pull_url(spec: str, show: bool) -> Path:
    url, fragment = urldefrag(spec)
    sha: str | None = None
    if fragment:
        given = re.fullmatch(r"sha256=([0-9a-fA-F]{64})", fragment)
        if not given:
            raise ValueError(f"the only fragment a model URL takes is #sha256=<64 hex>: {spec!r}")
        sha = given[1].lower()
    name = unquote(urlsplit(url).path).rsplit("/", 1)[-1]
    if name in ("", ".", "..") or "\\" in name or "\0" in name:
        name = "download"
    key = hashlib.sha256((url + (f"#sha256={sha}" if sha else "")).encode()).hexdigest()
    dest = cache_dir() / "url" / key / name
    if not _cached(dest):
        _download(url, dest, sha, None, name, show)
    return dest


# -- downloads ----------------------------------------------------------------


def _sidecar(dest: Path) -> Path:
    return dest.with_name(dest.name + ".pulled.json")


def _cached(dest: Path) -> bool:
    """The file is there, whole, and was checked when it was pulled."""
    size = _read_json(_sidecar(dest)).get("size")
    try:
        return isinstance(size, int) and dest.stat().st_size == size
    except OSError:
        return False


class _Partial:
    """A ``.part`` file and the SHA-256 of the bytes in it so far."""

    def __init__(self, path: Path) -> None:
        self.hash = hashlib.sha256()
        self.size = 0
        self.resumed = False
        if path.is_file():
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    self.hash.update(chunk)
                    self.size += len(chunk)
            self.resumed = self.size > 0
        self.file: IO[bytes] = path.open("ab")

    def restart(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.hash.update(chunk)
        self.size += len(chunk)


class _Cut(Exception):
    """A transfer that ended early; ``progressed`` if it brought bytes."""

    def __init__(self, reason: str, progressed: bool) -> None:
        super().__init__(reason)
        self.progressed = progressed


def _download(
    url: str, dest: Path, sha256: str | None, size: int | None, label: str, show: bool
) -> None:
    """Fetch ``url`` into ``dest`` through ``dest.part``, checked (see the
    module docs); ``sha256`` and ``size`` as the file list gives them."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest.parent):
        if _cached(dest):  # another process pulled it meanwhile
            return
        part = dest.with_name(dest.name + ".part")
        if dest.is_file():  # renamed but not recorded: check it as a part
            dest.replace(part)
        meter = _Meter(label, show)
        partial = _Partial(part)
        try:
            linked = _fetch(url, partial, size, meter)
            want_sha = sha256 or linked["sha256"]
            want_size = size if size is not None else linked["size"]
            if partial.resumed and _mismatch(partial, want_sha, want_size):
                partial.restart()  # an old .part may hold other bytes: once more from zero
                linked = _fetch(url, partial, size, meter)
        finally:
            partial.file.close()
            meter.close()
        problem = _mismatch(partial, want_sha, want_size)
        if problem:
            part.unlink(missing_ok=True)
            raise ChecksumMismatchError(f"{label}: {problem}; the download was deleted")
        part.replace(dest)
        record = {
            "size": partial.size,
            "sha256": partial.hash.hexdigest(),
            "checked": bool(want_sha),  # False: no checksum to compare with
            "url": url,
            "commit": linked["commit"],
        }
        _write_json(_sidecar(dest), record)


def _mismatch(partial: _Partial, sha256: str | None, size: int | None) -> str | None:
    """What is wrong with the bytes, or None."""
    digest = partial.hash.hexdigest()
    if sha256 and digest != sha256:
        return f"its SHA-256 is {digest}, but the source says {sha256}"
    if size is not None and partial.size != size:
        return f"it has {partial.size} bytes, but the source says {size}"
    return None


def _fetch(url: str, partial: _Partial, size: int | None, meter: _Meter) -> dict[str, Any]:
    """Bring ``partial`` to the whole file, resuming and retrying cuts; the
    hub's headers about it (``sha256``, ``size``, ``commit``)."""
    attempt = 0
    while True:
        attempt += 1
        if size is not None and partial.size > size:
            partial.restart()
        if size is not None and 0 < size == partial.size:
            # Whole already: a pull that stopped before its rename.
            return {"sha256": None, "size": None, "commit": None}
        try:
            return _transfer(url, partial, meter)
        except _Cut as e:
            if attempt < _ATTEMPTS and e.progressed:
                continue
            again = "; pull again to resume" if partial.size else ""
            raise PullError(f"{meter.label}: {e}{again}") from e.__cause__


def _transfer(url: str, partial: _Partial, meter: _Meter) -> dict[str, Any]:
    """One request: the rest of the file from ``partial.size`` on."""
    start = partial.size
    headers = {"Range": f"bytes={start}-"} if start else {}
    try:
        response, linked = _open(url, headers, meter.label)
    except _RangeRefused:
        partial.restart()  # the part is longer than the file: start over
        raise _Cut("the server refused the resume", progressed=True) from None
    with response:
        if response.status == 206:
            content_range = response.headers.get("Content-Range", "")
            got = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", content_range)
            if not got or int(got[1]) != start:
                partial.restart()
                raise _Cut("the server resumed at the wrong offset", progressed=True)
            total = int(got[2]) if got[2] != "*" else None
        elif response.status == 200:
            partial.restart()  # the server ignored the Range: from zero
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
        else:
            raise PullError(f"{meter.label}: unexpected HTTP {response.status} from {url}")
        before = partial.size
        meter.begin(before)
        try:
            while chunk := response.read(_CHUNK):
                partial.write(chunk)
                meter.show(partial.size, total)
        except OSError as e:
            raise _Cut(f"the connection failed ({e})", partial.size > before) from e
        if total is not None and partial.size < total:
            raise _Cut(
                f"the connection closed after {partial.size} of {total} bytes",
                partial.size > before,
            )
    sha = linked.get("x-linked-etag", "").strip().removeprefix("W/").strip('"').lower()
    size = linked.get("x-linked-size", "")
    return {
        "sha256": sha if _SHA256.fullmatch(sha) else None,
        "size": int(size) if size.isdigit() else None,
        "commit": linked.get("x-repo-commit"),
    }


# -- HTTP ------------------------------------------------------------------------


class _RangeRefused(PullError):
    """HTTP 416: a Range past the end of the file (caught by _transfer)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects come back as errors: :func:`_open` follows them itself, to
    read the hub's headers on the way and keep the token off other hosts."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _open(url: str, headers: Mapping[str, str], label: str) -> tuple[Any, dict[str, str]]:
    """The response at the end of ``url``'s redirects, and the hub's
    ``X-Linked-*`` / ``X-Repo-Commit`` headers met on the way (lower case)."""
    linked: dict[str, str] = {}
    hub_host = urlsplit(_endpoint()).netloc
    token = os.environ.get("HF_TOKEN")
    for _ in range(_MAX_REDIRECTS):
        request = urllib.request.Request(url, headers={**_HEADERS, **headers})
        if token and urlsplit(url).netloc == hub_host:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            response = _OPENER.open(request, timeout=_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            with contextlib.closing(e):
                _collect(e.headers, linked)
                location = e.headers.get("Location")
                if e.code in _REDIRECTS and location:
                    url = urljoin(url, location)
                    continue
                raise _http_error(e, url, label) from None
        except OSError as e:  # URLError, refused, reset, timeouts
            reason = getattr(e, "reason", e)
            raise PullError(f"{label}: cannot reach {urlsplit(url).netloc}: {reason}") from e
        _collect(response.headers, linked)
        return response, linked
    raise PullError(f"{label}: more than {_MAX_REDIRECTS} redirects from {url}")


def _collect(headers: Message, into: dict[str, str]) -> None:
    for name in _LINKED:
        value = headers.get(name)
        if value:
            into.setdefault(name.lower(), value)


def _http_error(e: urllib.error.HTTPError, url: str, label: str) -> PullError:
    why = e.headers.get("X-Error-Message") or e.reason
    if e.code == 404:
        return PullNotFoundError(f"{label}: not found: {url} ({why})")
    if e.code in (401, 403):
        return PullNotFoundError(
            f"{label}: not found, or private or gated (set HF_TOKEN to a token with "
            f"access): {url} (HTTP {e.code}: {why})"
        )
    if e.code == 416:
        return _RangeRefused(f"{label}: HTTP 416 from {url}")
    return PullError(f"{label}: HTTP {e.code} from {url} ({why})")


# -- the cache's small files, the lock, the progress line -------------------------


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Written whole or not at all (a reader never sees half of it)."""
    temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(data, indent=1, sort_keys=True))
    temp.replace(path)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One pull at a time into ``folder`` across processes (two would append
    to one ``.part``): ``flock`` on the folder, or on Windows a byte-range
    lock (``msvcrt.locking``) on a ``<folder>.lock`` file beside it (in it,
    it would be a file of the download)."""
    try:
        import fcntl
    except ImportError:
        with _locked_windows(folder):
            yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def _locked_windows(folder: Path) -> Iterator[None]:
    import msvcrt

    lock = folder.with_name(folder.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o600)
    try:
        while True:
            try:  # LK_LOCK tries for ten seconds, then raises
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # type: ignore[attr-defined]
                break
            except OSError:
                continue
        yield
    finally:
        os.close(fd)  # closing releases the lock


class _Meter:
    """One rewritten progress line on stderr, at most ten times a second."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.started = time.monotonic()
        self.offset = 0  # where this transfer began (a resume's offset)
        self.shown = 0.0

    def begin(self, offset: int) -> None:
        self.started, self.offset = time.monotonic(), offset

    def show(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.shown < 0.1:
            return
        self.shown = now
        rate = (done - self.offset) / 2**20 / max(now - self.started, 1e-3)
        of = f" / {total / 2**20:,.1f} MiB ({100 * done / total:.0f}%)" if total else " MiB"
        line = f"pulling {self.label}: {done / 2**20:,.1f}{of}, {rate:.1f} MiB/s"
        sys.stderr.write(f"\r\033[K{line}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
