"""API keys: every route but ``/health`` wants one of the server's keys,
as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key:
<key>`` (Anthropic's). A request without a right key gets 401 with
the error body of the caller's API (Anthropic's on ``/v1/messages``,
OpenAI's elsewhere). Keys come from ``--api-key`` (repeatable),
``--api-key-file`` (one key a line) and ``LLOYAL_API_KEY``."""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health"})


def api_keys(
    keys: Sequence[str] = (), files: Sequence[str | os.PathLike[str]] = ()
) -> tuple[str, ...]:
    """The keys given, those in ``files`` (one a line; blank lines and
    ``#`` comments skipped) and ``LLOYAL_API_KEY``. Raises ``ValueError``
    for an empty key or a file with none."""
    out = list(keys)
    for f in files:
        lines = Path(f).read_text().splitlines()
        found = [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]
        if not found:
            raise ValueError(f"{f}: no API key in it")
        out += found
    env = os.environ.get("LLOYAL_API_KEY")
    if env:
        out.append(env)
    if any(not k or k != k.strip() for k in out):
        raise ValueError("an API key must not be empty or start or end with spaces")
    return tuple(dict.fromkeys(out))


def _given(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries, as the bytes it sent: a key written in
    UTF-8 (non-ASCII) is compared with the configured key's UTF-8."""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
        if name == b"x-api-key":
            return value.strip()
    return None


class RequireKey:
    """ASGI middleware: HTTP requests need one of ``keys`` (none: open)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode("utf-8") for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _given(scope["headers"])
        # Every key compared, in constant time each.
        ok = given is not None and any([hmac.compare_digest(given, k) for k in self.keys])
        if ok:
            await self.app(scope, receive, send)
            return
        message = "Invalid API key" if given is not None else "An API key is required"
        message += ": send Authorization: Bearer <key> or x-api-key"
        error: dict[str, object]
        if scope["path"].startswith("/v1/messages"):  # Anthropic's clients
            error = {"type": "error", "error": {"type": "authentication_error", "message": message}}
        else:
            error = {
                "error": {
                    "message": message,
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
        body = json.dumps(error).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
