"""Models from the Hugging Face hub or a URL: ``lloyal pull`` and ``--model hf:...``.

:func:`resolve_model` turns a model spec into a file: a local path as it
is; ``hf:org/repo[@REV][:QUANT]`` (the ``Q4_K_M`` file by default, never a
``mmproj*`` projector; a split model whole, its first part returned) or
``hf:org/repo[@REV]/path/file.gguf`` pulled into the standard Hugging Face
cache; ``https://...[#sha256=<hex>]`` into ``$LLOYAL_CACHE_DIR/url``.

The transfer is ``huggingface_hub``'s (``pip install 'lloyal[hub]'``). This
module is the glue, and the checks a cache of files that a parser will read
needs: new bytes against the SHA-256 and size in the hub's file list, a
bounded file list, and the hub's names (revisions, commits, ETags) and the
cache's links confined to the cache. docs/pull.md has the whole contract.

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
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, unquote, urldefrag, urlsplit

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
_COMMIT = re.compile(r"[0-9a-f]{40}")
# What an ETag may be when the hub's client makes a file name of it.
_ETAG = re.compile(r'(?:W/)?"?[0-9A-Za-z_-]{1,128}"?')
_MAX_FILES = 100_000  # entries of one repository's listing
_MAX_PAGES = 1_000  # pages of one listing (the hub sends 1,000 entries a page)
_CHUNK = 1 << 20
_HEADERS = {"User-Agent": f"lloyal/{__version__}", "Accept-Encoding": "identity"}
_OFF = ("", "0", "false", "no", "off")


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
    or a URL into the cache, checked, and return its path. ``progress``:
    progress bars on stderr (default: when stderr is a terminal).

    Raises :class:`~lloyal.errors.PullNotFoundError` (404, or no file
    matching the quantization, or offline and not cached),
    :class:`~lloyal.errors.ChecksumMismatchError` and
    :class:`~lloyal.errors.PullError` (the network, other HTTP errors, a
    hub answer refused, ``huggingface_hub`` not installed).

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


def _hf() -> ModuleType:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError as e:
        raise PullError(
            "pulling a model needs the Hugging Face hub's client: pip install 'lloyal[hub]'"
        ) from e
    return huggingface_hub


# -- hf: specs ----------------------------------------------------------------


@dataclass(frozen=True)
class _Remote:
    """A file the repository's listing gives."""

    size: int | None
    sha256: str | None


_UNLISTED = _Remote(None, None)


@dataclass(frozen=True)
class _Spec:
    repo: str
    rev: str
    quant: str | None
    path: str | None

    @property
    def where(self) -> str:
        return f"{self.repo}@{self.rev}"


def _parse(spec: str, revision: str | None) -> _Spec:
    found = _HF_SPEC.fullmatch(spec)
    if not found:
        raise ValueError(
            f"not a hub model: {spec!r}; expected hf:org/repo, hf:org/repo:QUANT "
            "or hf:org/repo/path/file.gguf (@REV after the repo for a revision)"
        )
    if found["rev"] and revision and found["rev"] != revision:
        raise ValueError(f"{spec!r} names revision {found['rev']!r} but --revision is {revision!r}")
    rev = _relative(found["rev"] or revision or DEFAULT_REVISION, spec, ValueError, "revision")
    path = found["path"]
    if path is not None:
        path = _relative(path, spec, ValueError)
    return _Spec(found["repo"], rev, found["quant"], path)


def _pull_hf(spec: str, revision: str | None, show: bool) -> Path:
    want = _parse(spec, revision)
    hf = _hf()
    cache = _hub_cache(hf)
    offline = _offline(hf)
    with _guarded(hf), _translated(hf, want.where):
        listing: dict[str, _Remote] = {}
        unreachable: str | None = None
        if not offline:
            try:
                listing = _listing(hf, want)
            except _Unreachable as e:
                offline = True  # the cache answers, as the hub's client does
                unreachable = str(e)
        if offline:
            listing = _cached_listing(cache, want, unreachable)
        why = f"cannot reach the hub: {unreachable}" if unreachable else "offline"
        where = f"{want.where} ({why}; the cache's files)" if offline else want.where
        try:
            if want.path is None:
                paths = _choose(listing, want.quant, where)
            else:
                paths = _split_parts(want.path, listing, where)
        except PullNotFoundError as e:
            if unreachable is None:
                raise
            raise PullError(str(e)) from e  # the network's fault, not the hub's answer
        got = [
            _download(hf, cache, want, p, listing.get(p, _UNLISTED), label, show, offline)
            for p, label in zip(paths, _labels(paths), strict=True)
        ]
    return got[0]


def _labels(paths: list[str]) -> list[str]:
    return paths if len(paths) == 1 else [f"{p} ({i}/{len(paths)})" for i, p in enumerate(paths, 1)]


class _Unreachable(Exception):
    """The hub cannot be reached: the cache is asked instead."""


def _listing(hf: ModuleType, want: _Spec) -> dict[str, _Remote]:
    """Every file of the repository at the revision: the hub's tree API, its
    pages followed through the hub client's session, bounded (a list that
    repeats itself, or runs past :data:`_MAX_FILES` files or
    :data:`_MAX_PAGES` pages, is refused). Asked once, not retried: a hub
    that cannot be reached sends the pull to the cache at once."""
    session = hf.utils.get_session()
    headers = hf.utils.build_hf_headers(library_name="lloyal", library_version=__version__)
    url: str | None = (
        f"{_endpoint(hf)}/api/models/{want.repo}/tree/{quote(want.rev, safe='')}?recursive=true"
    )
    files: dict[str, _Remote] = {}
    pages = 0
    while url is not None:
        pages += 1
        if pages > _MAX_PAGES:
            raise PullError(f"{want.where}: the hub's file list runs on; refused")
        try:
            response = session.get(url, headers=headers, timeout=hf.constants.HF_HUB_ETAG_TIMEOUT)
        except _transport_errors() as e:
            raise _Unreachable(_first_line(e)) from e
        hf.utils.hf_raise_for_status(response)
        try:
            entries = response.json()
        except ValueError:
            entries = None
        if not isinstance(entries, list):
            raise PullError(f"{want.where}: unreadable file list from {url}")
        for entry in entries:
            if not isinstance(entry, dict) or entry.get("type", "file") != "file":
                continue
            path = entry.get("path")
            if not isinstance(path, str):
                continue
            if path in files or len(files) >= _MAX_FILES:
                raise PullError(f"{want.where}: the hub's file list repeats or runs on; refused")
            lfs = entry.get("lfs")
            lfs = lfs if isinstance(lfs, dict) else {}
            size = lfs.get("size", entry.get("size"))
            sha = lfs.get("oid")
            files[path] = _Remote(
                size if isinstance(size, int) and size >= 0 else None,
                sha.lower() if isinstance(sha, str) and _SHA256.fullmatch(sha.lower()) else None,
            )
        url = response.links.get("next", {}).get("url")
    return files


def _cached_listing(cache: Path, want: _Spec, unreachable: str | None) -> dict[str, _Remote]:
    """The files the cache holds of the repository at the revision, when
    offline (``unreachable``: why the hub could not be asked)."""
    storage = cache / _folder(want.repo)
    commit = want.rev
    if not _COMMIT.fullmatch(commit):
        try:
            commit = (storage / "refs" / want.rev).read_text().strip()
        except OSError:
            commit = ""
    snapshot = storage / "snapshots" / commit
    if not _COMMIT.fullmatch(commit) or not snapshot.is_dir():
        if unreachable is not None:
            raise PullError(
                f"{want.where}: cannot reach the hub ({unreachable}), and the "
                f"Hugging Face cache ({cache}) does not hold it"
            )
        raise PullNotFoundError(
            f"{want.where}: offline ($HF_HUB_OFFLINE), and the Hugging Face cache "
            f"({cache}) does not hold it"
        )
    return {
        f.relative_to(snapshot).as_posix(): _UNLISTED for f in snapshot.rglob("*") if f.is_file()
    }


def _download(
    hf: ModuleType,
    cache: Path,
    want: _Spec,
    path: str,
    remote: _Remote,
    label: str,
    show: bool,
    offline: bool,
) -> Path:
    """One file into the cache (or found there), confined and checked."""
    storage = cache / _folder(want.repo)
    before = set((storage / "snapshots").glob(f"*/{path}"))
    got = Path(
        hf.hf_hub_download(
            want.repo,
            path,
            revision=want.rev,
            cache_dir=cache,
            endpoint=_endpoint(hf),
            local_files_only=offline,
            library_name="lloyal",
            library_version=__version__,
            tqdm_class=_bar(label, show, remote.size),
        )
    )
    target = _confined(got, storage, want.where)
    if got in before or offline:
        return got  # the cache's, named by its hash when it was stored
    if remote.size is not None and target.stat().st_size != remote.size:
        problem: str | None = f"{target.stat().st_size} bytes where the hub lists {remote.size}"
    else:
        problem = _mismatch(target, remote.sha256 or _named_sha(target))
    if problem is not None:
        for f in (got, target):
            f.unlink(missing_ok=True)
        raise ChecksumMismatchError(f"{label}: {problem}; not kept")
    return got


def _confined(got: Path, storage: Path, where: str) -> Path:
    """The file a cache entry stands for, if it lies in the repository's
    folder: a link the cache did not make (one that leads out) is refused."""
    root = storage.resolve()
    target = got.resolve()
    if root not in target.parents or not target.is_file():
        if got.is_symlink():
            got.unlink()  # the link itself, never what it leads to
        raise PullError(
            f"{where}: {got} leads to {target}, outside the cache's folder {root}; "
            "refused (delete the link to pull again)"
        )
    return target


def _named_sha(blob: Path) -> str | None:
    """A blob's SHA-256 from its name: the hub's ETag of a large (LFS) file."""
    return blob.name if _SHA256.fullmatch(blob.name) else None


def _mismatch(file: Path, sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    actual = _sha256(file)
    return None if actual == sha256 else f"SHA-256 {actual}, expected {sha256}"


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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


def _split_parts(path: str, tree: Mapping[str, _Remote], where: str) -> list[str]:
    """``path`` alone, or every part of the split model it is a part of."""
    split = _SPLIT.search(path)
    if not split:
        return [path]
    count = int(split[2])
    stem, suffix = path[: split.start()], path[split.end() - len(".gguf") :]
    parts = [f"{stem}-{i:05d}-of-{split[2]}{suffix}" for i in range(1, count + 1)]
    missing = [p for p in parts if p not in tree]
    if missing and path in tree:  # an unlisted file is the hub's to refuse
        raise PullNotFoundError(f"{where}: split model without its parts {', '.join(missing)}")
    return parts


def _relative(path: str, where: str, error: type[Exception], what: str = "file path") -> str:
    """A repository path (or revision) that stays inside its folder in the cache."""
    parts = path.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        raise error(f"{where}: not a {what} in a repository: {path!r}")
    return path


def _folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _endpoint(hf: ModuleType) -> str:
    """``$HF_ENDPOINT`` as it is now (the hub's client reads it at import)."""
    return str(os.environ.get("HF_ENDPOINT", hf.constants.ENDPOINT)).rstrip("/")


def _hub_cache(hf: ModuleType) -> Path:
    """The Hugging Face cache as the environment names it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(hf.constants.HF_HUB_CACHE)


def _offline(hf: ModuleType) -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return bool(hf.constants.HF_HUB_OFFLINE) or (flag or "").strip().lower() not in _OFF


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection errors of ``httpx2`` (``huggingface_hub`` 2) or ``httpx`` (1)."""
    modules = (sys.modules.get(name) for name in ("httpx2", "httpx"))
    return tuple(m.TransportError for m in modules if m is not None)


@contextlib.contextmanager
def _translated(hf: ModuleType, where: str) -> Iterator[None]:
    """The hub client's errors as :mod:`lloyal.errors`."""
    errors = hf.errors
    try:
        yield
    except PullError:
        raise
    except (errors.EntryNotFoundError, errors.HfHubHTTPError) as e:
        # Private and gated repositories answer 401/403 without access.
        status = getattr(getattr(e, "response", None), "status_code", None)
        missing = status in (401, 403, 404) or isinstance(e, errors.EntryNotFoundError)
        if isinstance(e, errors.GatedRepoError):
            where += " (gated: accept its terms on the hub and set $HF_TOKEN)"
        error = PullNotFoundError if missing else PullError
        raise error(f"{where}: not found or refused: {_first_line(e)}") from e
    except (errors.OfflineModeIsEnabled, *_transport_errors(), OSError) as e:
        raise PullError(f"{where}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# -- what the hub sends -------------------------------------------------------

_guard_lock = threading.Lock()
_guard_users = 0


class _Refused(PullError):
    """A hub answer that would make the cache reach outside itself."""


def _check_response(response: Any) -> None:
    """An event hook on the hub client's HTTP session, while a pull runs:
    it refuses commits and ETags that the client would make file names of
    and are not such names."""
    headers = response.headers
    commit = headers.get("X-Repo-Commit")
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise _Refused(f"the hub sent commit {commit[:80]!r}, not a commit id; refused")
    if response.request.method == "HEAD":
        for name in ("X-Linked-Etag", "ETag"):
            value = headers.get(name)
            if value is not None and not _ETAG.fullmatch(value):
                raise _Refused(f"the hub sent {name} {value[:80]!r}, not a file name; refused")


@contextlib.contextmanager
def _guarded(hf: ModuleType) -> Iterator[None]:
    """:func:`_check_response` on the hub client's session while pulls run."""
    global _guard_users
    hooks = hf.utils.get_session().event_hooks["response"]
    with _guard_lock:
        if _check_response not in hooks:
            hooks.append(_check_response)
        _guard_users += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard_users -= 1
            if _guard_users == 0 and _check_response in hooks:
                hooks.remove(_check_response)


def _bar(label: str, show: bool, limit: int | None) -> type:
    """A progress bar class for the hub's client that also stops a body
    running past the size the listing gave (``limit``)."""
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    class Bar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs.update(desc=f"pulling {label}", disable=not show, file=sys.stderr)
            self.seen = kwargs.get("initial", 0) or 0
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self.seen += n or 0
            if limit is not None and self.seen > limit:
                raise PullError(f"{label}: the body runs past the listed {limit:,} bytes; cut off")
            return bool(super().update(n))

    return Bar


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
    if name in ("", ".", "..") or "\\" in name or "\0" in name or name.startswith("."):
        name = "download"
    key = hashlib.sha256((url + (f"#sha256={sha}" if sha else "")).encode()).hexdigest()
    dest = cache_dir() / "url" / key / name
    if _cached(dest):
        return dest
    hf = _hf()
    import filelock

    dest.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(dest.parent / ".lock"), _translated(hf, name):
        if not _cached(dest):
            _fetch(hf, url, dest, sha, name, show)
    return dest


def _fetch(hf: ModuleType, url: str, dest: Path, sha: str | None, name: str, show: bool) -> None:
    """``url`` into ``dest``: resumed from ``NAME.part``, checked, renamed."""
    part = dest.with_name(dest.name + ".part")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    if part.is_symlink():
        part.unlink()  # not a file this cache made
    with os.fdopen(os.open(part, flags, 0o644), "r+b") as f:
        # From where an interrupted pull left the part; once more from zero
        # if the server refuses the range (416) or the part was other bytes.
        for start in (f.seek(0, os.SEEK_END), 0):
            f.seek(start)
            f.truncate()
            try:
                bar = _bar(name, show, None)
                hf.file_download.http_get(
                    url, f, resume_size=start, headers=_HEADERS, tqdm_class=bar
                )
            except hf.errors.HfHubHTTPError as e:
                if start and getattr(e.response, "status_code", None) == 416:
                    continue
                raise
            f.flush()
            if not start or sha is None or _sha256(part) == sha:
                break
    actual = _sha256(part)
    if sha is not None and actual != sha:
        part.unlink()
        raise ChecksumMismatchError(f"{name}: SHA-256 {actual}, expected {sha}; not kept")
    os.replace(part, dest)  # replaces a link at dest, never writes through it
    record = {"size": dest.stat().st_size, "sha256": actual, "checked": sha is not None}
    _write_json(_sidecar(dest), {**record, "url": url})


def _sidecar(dest: Path) -> Path:
    return dest.with_name(dest.name + ".pulled.json")


def _cached(dest: Path) -> bool:
    """The file is there, whole, a file of the cache's own (not a link)."""
    size = _read_json(_sidecar(dest)).get("size")
    try:
        return not dest.is_symlink() and isinstance(size, int) and dest.stat().st_size == size
    except OSError:
        return False


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
