"""The HTTP plumbing every API's routes share: error bodies, the handler
that maps exceptions to them, server-sent events, disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from lloyal.errors import ChatTemplateError, GrammarError, LloyalError
from lloyal.server._engine import ChoiceEvent
from lloyal.server._models import Models
from lloyal.server._protocol import ApiError, parse_json
from lloyal.server._state import State

log = logging.getLogger("lloyal.server")


ErrorBody = Callable[[ApiError], dict[str, Any]]


def error_response(e: ApiError, body: ErrorBody = ApiError.body) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(body(e), status_code=e.status, headers=headers)


def internal_error(e: BaseException) -> ApiError:
    """What a client is told of a failure that is not its request's fault
    (the traceback goes to the log)."""
    log.error("a request failed", exc_info=e)
    return ApiError(
        f"the server failed on this request ({type(e).__name__})", status=500, kind="server_error"
    )


def handler(
    fn: Callable[[Request, State], Awaitable[Response]], body: ErrorBody = ApiError.body
) -> Callable[[Request], Awaitable[ASGIApp]]:
    """A route on the model its request names (``model`` in the JSON body,
    or in the query), leased until the response is sent. Errors map to
    error bodies (OpenAI's unless ``body`` says otherwise): bad input is a
    400, never a 500, and whatever else goes wrong is a 500 with the same
    body, never text."""

    async def route(request: Request) -> ASGIApp:
        models: Models = request.app.state.lloyal
        lease = None
        try:
            lease = models.lease(await _model_named(request))
            state = await lease.__aenter__()
            request.state.lloyal = state
            response = await fn(request, state)
        except BaseException as e:
            if lease is not None:
                await lease.__aexit__(None, None, None)
            if not isinstance(e, Exception):
                raise
            return _error(e, body)
        return _Leased(response, lease)

    return route


def registry_handler(
    fn: Callable[[Request, Models], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A route on the server's models as a whole (no lease)."""

    async def route(request: Request) -> Response:
        try:
            return await fn(request, request.app.state.lloyal)
        except Exception as e:
            return _error(e, ApiError.body)

    return route


def _error(e: Exception, body: ErrorBody) -> Response:
    if isinstance(e, ClientGone):
        return Response(status_code=499)
    if isinstance(e, ApiError):
        return error_response(e, body)
    if isinstance(e, (GrammarError, ChatTemplateError, ValueError, TypeError)):
        return error_response(ApiError(str(e)), body)
    if isinstance(e, LloyalError):
        return error_response(ApiError(str(e), status=500, kind="server_error"), body)
    return error_response(internal_error(e), body)


async def _model_named(request: Request) -> str | None:
    """The ``model`` a request names, if any."""
    if request.method == "GET":
        return request.query_params.get("model")
    try:
        parsed = await read_body(request)
    except ApiError:
        return None  # the route says what is wrong with it
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


class _Leased:
    """A response that holds its model's lease until it has been sent."""

    def __init__(self, response: Response, lease: AbstractAsyncContextManager[State]) -> None:
        self.response = response
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.lease.__aexit__(None, None, None)


async def read_body(request: Request) -> object:
    """The request's JSON, parsed once (the route and the model lookup
    both read it)."""
    if not hasattr(request.state, "json"):
        request.state.json = parse_json(await request.body())
    return request.state.json


# Characters that str.splitlines (and so line readers built on it, such as
# httpx's iter_lines) take for line breaks, though SSE ends lines only at CR
# and LF: escaped in an event's JSON, so such a client never cuts an event.
_LINE_BREAKS = str.maketrans(
    {c: f"\\u{ord(c):04x}" for c in "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}
)


def sse_json(obj: object) -> str:
    """``obj`` as JSON for one SSE data line (UTF-8, line breaks escaped)."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)


def sse(obj: object) -> bytes:
    return f"data: {sse_json(obj)}\n\n".encode()


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``, cancelling it if the client goes away (its branches
    are freed by the generator's cleanup)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if not done and await request.is_disconnected():
            task.cancel()
            state: State = request.state.lloyal
            state.engine.metrics.disconnects += 1
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    return task.result()


class ClientGone(Exception):
    """The client left before its response started (answered 499, which
    it never sees)."""


async def primed(events: AsyncGenerator[ChoiceEvent, None], request: Request) -> Primed:
    """``events`` with its first item already taken, so that admission,
    the prompt and the first token happen before the response starts and
    their errors get a status code of their own (429, 503, 400). A client
    that leaves meanwhile (waiting in the queue, or during its prefill) is
    dropped at once: its work is cancelled and its branches freed."""
    first_item = asyncio.ensure_future(events.__anext__())
    try:
        while not first_item.done():
            done, _ = await asyncio.wait({first_item}, timeout=0.1)
            if not done and await request.is_disconnected():
                first_item.cancel()
                # Counted when seen, as for a whole response: the cleanup
                # that follows may wait for the worker.
                state: State = request.state.lloyal
                state.engine.metrics.disconnects += 1
                await asyncio.gather(first_item, return_exceptions=True)
                raise ClientGone()
        first: ChoiceEvent | None = first_item.result()
    except StopAsyncIteration:
        first = None
    except BaseException:
        first_item.cancel()
        await asyncio.gather(first_item, return_exceptions=True)
        await events.aclose()
        raise
    return Primed(first, events)


class Primed:
    def __init__(self, first: ChoiceEvent | None, rest: AsyncGenerator[ChoiceEvent, None]) -> None:
        self._first = first
        self._rest = rest

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> ChoiceEvent:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        await self._rest.aclose()


def event_stream(
    state: State,
    source: Primed,
    bodies: AsyncGenerator[dict[str, Any], None],
    *,
    encode: Callable[[dict[str, Any]], bytes] | None = None,
    done: bytes | None = b"data: [DONE]\n\n",
    error_body: ErrorBody = ApiError.body,
    media_type: str = "text/event-stream",
) -> StreamingResponse:
    """Server-sent events: each body (``encode``: OpenAI's ``data:``
    lines by default), then ``done``; an error mid-stream as an error body;
    a client gone counted, and its branches freed."""
    encode = encode or sse

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for body in bodies:
                yield encode(body)
            if done is not None:
                yield done
        except ApiError as e:
            yield encode(error_body(e))
        except Exception as e:  # the status went out with the first chunk
            yield encode(error_body(internal_error(e)))
        except asyncio.CancelledError:
            state.engine.metrics.disconnects += 1
            raise
        finally:
            await bodies.aclose()
            await source.aclose()

    return StreamingResponse(stream(), media_type=media_type)
