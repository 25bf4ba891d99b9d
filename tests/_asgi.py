"""The server as an ASGI app in this process, and an httpx client of it
(no port, no subprocess: a test can reach inside the app)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from lloyal.server import ServerConfig, create_app
from starlette.applications import Starlette

from tests._hang import HANG_GUARD_S


@contextlib.asynccontextmanager
async def in_process(config: ServerConfig) -> AsyncIterator[tuple[httpx.AsyncClient, Starlette]]:
    """The app started (its models open), a client of it, and the app."""
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://x", timeout=HANG_GUARD_S
        ) as c:
            yield c, app
