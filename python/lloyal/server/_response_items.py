"""A Responses reply as items (``reasoning``, ``message``,
``function_call``) and, streamed, as the Responses events in order
(:class:`ResponseStream`): the writer side of ``_responses``."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from lloyal.server._chat import (
    CallArguments,
    CallStart,
    ChatChoice,
    Delta,
    ReasoningDelta,
    Reply,
    TextDelta,
)

__all__ = ["ItemIds", "ResponseStream", "output_items", "sse"]


class ItemIds:
    """The ids of one response's items, the same streamed and whole."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:24]
        self.response = f"resp_{tag}"
        self.message = f"msg_{tag}"
        self.reasoning = f"rs_{tag}"

    def call(self, call_id: str) -> str:
        return f"fc_{call_id.removeprefix('call_')}"


def _message_item(ids: ItemIds, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": ids.message,
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(ids: ItemIds, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": ids.reasoning,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _call_item(
    ids: ItemIds, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": ids.call(call_id),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(ids: ItemIds, reply: Reply) -> list[dict[str, Any]]:
    """The reply's items; when ``max_output_tokens`` cut it, the last one
    (where the cut fell) is ``incomplete``, as streamed."""
    items: list[dict[str, Any]] = []
    if reply.reasoning:
        items.append(_reasoning_item(ids, reply.reasoning))
    if reply.content or not reply.calls:
        items.append(_message_item(ids, reply.content, "completed"))
    items += [_call_item(ids, c.id, c.name, c.arguments, "completed") for c in reply.calls]
    if reply.finish == "length" and items and items[-1]["type"] != "reasoning":
        items[-1]["status"] = "incomplete"
    return items


def sse(body: dict[str, Any]) -> bytes:
    return f"event: {body['type']}\ndata: {json.dumps(body)}\n\n".encode()


class ResponseStream:
    """A reply's typed deltas as Responses events: an item opened when its
    kind starts, its deltas, and its ``done`` events when the next begins
    or the reply ends."""

    def __init__(self, ids: ItemIds, choice: ChatChoice) -> None:
        self.ids, self.choice = ids, choice
        self.sequence = 0
        self.index = -1  # output_index of the open item
        self.open: str | None = None  # "reasoning", "message" or a call's id
        self.text = ""  # the open item's text or arguments so far
        self.call: CallStart | None = None
        self.calls: dict[int, CallStart] = {}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(
        self,
        source: Any,  # the primed events
        start: dict[str, Any],
        finished: Any,
    ) -> AsyncGenerator[dict[str, Any], None]:
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        reply: Reply | None = None
        async for event in source:
            if event.finish is not None:
                for out in self._feed(self.choice.closing(event.finish)):
                    yield out
                reply = self.choice.final(event.finish)
            else:
                for out in self._feed(self.choice.delta(event.text)):
                    yield out
        for out in self._close("incomplete" if reply and reply.finish == "length" else "completed"):
            yield out
        assert reply is not None, "a stream ends with its finish"
        body = finished(reply)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        yield self._event(kind, response=body)

    def _feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        ids = self.ids
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if self.open != "reasoning":
                    out += self._start(
                        "reasoning", _reasoning_item(ids, "") | {"status": "in_progress"}
                    )
                self.text += d.text
                out.append(
                    self._event(
                        "response.reasoning_text.delta",
                        item_id=ids.reasoning,
                        output_index=self.index,
                        content_index=0,
                        delta=d.text,
                    )
                )
            elif isinstance(d, TextDelta):
                if self.open != "message":
                    item = _message_item(ids, "", "in_progress") | {"content": []}
                    out += self._start("message", item)
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    out.append(
                        self._event(
                            "response.content_part.added",
                            item_id=ids.message,
                            output_index=self.index,
                            content_index=0,
                            part=part,
                        )
                    )
                self.text += d.text
                out.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=ids.message,
                        output_index=self.index,
                        content_index=0,
                        delta=d.text,
                        logprobs=[],
                    )
                )
            elif isinstance(d, (CallStart, CallArguments)):
                call = d if isinstance(d, CallStart) else self.calls[d.index]
                self.calls[call.index] = call
                if self.open != call.id:
                    item = _call_item(ids, call.id, call.name, "", "in_progress")
                    out += self._start(call.id, item)
                    self.call = call
                if d.arguments:
                    self.text += d.arguments
                    out.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=ids.call(call.id),
                            output_index=self.index,
                            delta=d.arguments,
                        )
                    )
        return out

    def _start(self, key: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        self.index += 1
        self.open, self.text = key, ""
        out.append(self._event("response.output_item.added", output_index=self.index, item=item))
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        ids, at, text = self.ids, self.index, self.text
        out: list[dict[str, Any]] = []
        if self.open == "reasoning":
            out.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=ids.reasoning,
                    output_index=at,
                    content_index=0,
                    text=text,
                )
            )
            item = _reasoning_item(ids, text)
        elif self.open == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=ids.message,
                    output_index=at,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=ids.message,
                    output_index=at,
                    content_index=0,
                    part=part,
                )
            )
            item = _message_item(ids, text, status)
        else:
            call = self.call
            assert call is not None
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=ids.call(call.id),
                    output_index=at,
                    name=call.name,
                    arguments=text,
                )
            )
            item = _call_item(ids, call.id, call.name, text, status)
        out.append(self._event("response.output_item.done", output_index=at, item=item))
        self.open = None
        return out
