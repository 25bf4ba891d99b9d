"""A Hugging Face hub on 127.0.0.1, for tests/test_hub.py: the hub's URL
layout over http.server, served from a folder (``ROOT/org/repo/path``).

- ``GET /api/models/ORG/REPO/tree/REV?recursive=true``: the file list
  (``path``, ``size``, ``lfs: {oid, size}``), ``page_size`` entries a page
  with a ``Link: <...>; rel="next"`` header, as the hub pages it;
- ``GET /ORG/REPO/resolve/REV/PATH``: a 302 to ``/cdn/ORG/REPO/PATH`` with
  ``X-Linked-Etag`` (the SHA-256, quoted), ``X-Linked-Size``, ``ETag`` and
  ``X-Repo-Commit``; 404 with ``X-Error-Message`` for a missing repo or file;
- ``GET /cdn/...``: the bytes, with Range (206 and ``Content-Range``).

HEAD answers as GET does, without the body (the hub's client asks HEAD of
``resolve`` for a file's metadata).

Knobs: ``wrong_sha`` (advertise another SHA-256), ``cut_after`` (the first
CDN reply closes the connection after that many bytes), ``ignore_range``
(answer 200 to a Range), ``cdn_host`` (the host name the CDN redirect
names: ``localhost``, another host than the hub's 127.0.0.1, as the real
CDN is; the hub's client follows a redirect to its own host itself), and
for a hostile hub: ``commit`` and ``etag`` (the ``X-Repo-Commit`` and
``X-Linked-Etag`` sent), ``endless`` (a CDN body without a length that never
ends), ``self_link`` (each page of the file list links to itself as the
next), ``empty_pages`` (empty pages, each linking to another, for ever),
``tree_body`` (these bytes as the whole file list, for a fuzz).
``requests`` records ``(method, path, headers)`` of every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.page_size = 2
        self.wrong_sha = False
        self.cut_after: int | None = None
        self.ignore_range = False
        self.cdn_host = "localhost"
        self.commit = COMMIT
        self.etag: str | None = None
        self.endless = False
        self.self_link = False
        self.empty_pages = False
        self.tree_body: bytes | None = None
        self.sent = 0  # bytes of the last endless body
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._serve(self)

            def do_HEAD(self) -> None:
                hub._serve(self)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def add(self, repo: str, path: str, data: bytes) -> bytes:
        target = self.root / repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return data

    def sha(self, data: bytes) -> str:
        return hashlib.sha256(b"not this" if self.wrong_sha else data).hexdigest()

    def cdn_gets(self) -> list[dict[str, str]]:
        """The headers of each request for bytes."""
        return [h for m, p, h in self.requests if p.startswith("/cdn/") and m == "GET"]

    # -- the routes -------------------------------------------------------------

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        self.requests.append((h.command, h.path, dict(h.headers.items())))
        url = urlsplit(h.path)
        raw = url.path  # a revision's "/" comes quoted, as %2F
        if tree := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", raw):
            self._tree(h, unquote(tree[1]), parse_qs(url.query), raw)
        elif resolve := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", raw):
            self._resolve(h, unquote(resolve[1]), unquote(resolve[3]))
        elif raw.startswith("/cdn/"):
            self._cdn(h, self.root / unquote(raw).removeprefix("/cdn/"))
        else:
            self._reply(h, 404, b"", {"X-Error-Message": "no such route"})

    def _tree(
        self, h: BaseHTTPRequestHandler, repo: str, query: dict[str, list[str]], at: str
    ) -> None:
        if self.tree_body is not None:
            self._reply(h, 200, self.tree_body, {"Content-Type": "application/json"})
            return
        folder = self.root / repo
        if not folder.is_dir():
            self._reply(h, 404, b'{"error": "Repository not found"}', {})
            return
        entries = []
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            data = f.read_bytes()
            lfs = {"oid": self.sha(data), "size": len(data), "pointerSize": 130}
            entries.append(
                {
                    "type": "file",
                    "oid": hashlib.sha1(data).hexdigest(),
                    "size": len(data),
                    "path": f.relative_to(folder).as_posix(),
                    "lfs": lfs,
                }
            )
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.page_size]
        headers = {"Content-Type": "application/json"}
        cursor: int | None = None
        if self.self_link:
            cursor = start
        elif self.empty_pages:
            page, cursor = [], start + 1
        elif start + self.page_size < len(entries):
            cursor = start + self.page_size
        if cursor is not None:
            headers["Link"] = f'<{self.url}{at}?recursive=true&cursor={cursor}>; rel="next"'
        self._reply(h, 200, json.dumps(page).encode(), headers)

    def _resolve(self, h: BaseHTTPRequestHandler, repo: str, path: str) -> None:
        f = self.root / repo / path
        if not f.is_file():
            headers = {"X-Error-Message": "Entry not found", "X-Repo-Commit": self.commit}
            self._reply(h, 404, b"", headers)
            return
        data = f.read_bytes()
        host = f"{self.cdn_host}:{self.port}"
        headers = {
            "Location": f"http://{host}/cdn/{repo}/{path}",
            "X-Linked-Etag": f'"{self.etag or self.sha(data)}"',
            "X-Linked-Size": str(len(data)),
            "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
            "X-Repo-Commit": self.commit,
        }
        self._reply(h, 302, b"", headers)

    def _cdn(self, h: BaseHTTPRequestHandler, f: Path) -> None:
        if not f.is_file():
            self._reply(h, 404, b"", {})
            return
        data = f.read_bytes()
        if self.endless and h.command == "GET":
            self._endless(h)
            return
        asked = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        cut, self.cut_after = self.cut_after, None  # the first reply only
        if asked and not self.ignore_range:
            start = int(asked[1])
            if start >= len(data):
                self._reply(h, 416, b"", {"Content-Range": f"bytes */{len(data)}"})
                return
            status, body = 206, data[start:]
            extra = {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        else:
            status, body, extra = 200, data, {}
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        for k, v in extra.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(body if cut is None else body[:cut])
        h.close_connection = True

    def _endless(self, h: BaseHTTPRequestHandler) -> None:
        """A body with no length that goes on until the client leaves."""
        h.send_response(200)
        h.end_headers()
        self.sent = 0
        chunk = b"x" * 65536
        try:
            while self.sent < 1 << 30:
                h.wfile.write(chunk)
                self.sent += len(chunk)
        except OSError:
            pass
        h.close_connection = True

    @staticmethod
    def _reply(
        h: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command == "GET":
            h.wfile.write(body)
