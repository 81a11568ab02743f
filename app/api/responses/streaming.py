"""A response's stream events, as OpenAI sends them over SSE and over its websocket:
created, in_progress, then each output item as it starts (the message and its text
part, with text deltas; each function call, with argument deltas), the closing events
of each item, and ``response.completed`` (``incomplete`` at max_output_tokens or when
steered, ``failed`` on an error). Each event carries its ``sequence_number``.

Calls are told from text as the tokens arrive (the tool parser's stream); the closing
events carry the reply as read whole, which is the authority (``OutputParser.final``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from app.api.output_items import (
    ArgumentsDelta,
    CallClosed,
    CallOpened,
    ItemStatus,
    MessageClosed,
    MessageOpened,
    OutputItems,
    Step,
    TextDelta,
)
from app.api.responses import items
from app.api.responses.serving import PendingResponse, ResponsesService
from app.errors import APIError
from app.sessions.chunk import ChunkDelta, ChunkResult
from app.tools.parsing import ToolCall

_CLOSING = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "cancelled": "response.incomplete",
    "failed": "response.failed",
}
_EMPTY_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
Event = tuple[str, dict[str, Any]]


async def sse_frames(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def response_events(
    service: ResponsesService, owner: str, pending: PendingResponse, numbers: Iterator[int] | None = None
) -> AsyncGenerator[dict[str, Any], None]:
    """``numbers``: the sequence numbers to use (a websocket numbers its events across responses)."""
    numbers = numbers if numbers is not None else itertools.count()

    def frame(event: Event) -> dict[str, Any]:
        return {"type": event[0], "sequence_number": next(numbers), **event[1]}

    skeleton = service.in_progress(pending).model_dump(mode="json")
    yield frame(("response.created", {"response": skeleton}))
    yield frame(("response.in_progress", {"response": skeleton}))
    output = OutputItems(pending.parser)
    render = _Rendering(pending.message_id)
    if pending.request.generate:  # a warm-up answers nothing
        for event in render.steps(output.start()):
            yield frame(event)
    result: ChunkResult | None = None
    error: APIError | None = None
    try:
        async with contextlib.aclosing(pending.run.events()) as events:
            async for chunk_event in events:
                if isinstance(chunk_event, ChunkDelta):
                    for event in render.steps(output.feed(chunk_event.text, chunk_event.token_ids)):
                        yield frame(event)
                else:
                    result = chunk_event
                    for event in render.steps(output.feed("", [], finished=True)):
                        yield frame(event)
    except APIError as exc:
        error = exc
    response = service.finish(pending, result, error).model_dump(mode="json")
    if error is not None:
        yield frame(("error", {"code": error.code, "message": error.message, "param": error.param}))
    else:
        assert result is not None
        final = pending.parser.final(result.text, result.token_ids) if pending.request.generate else None
        status: ItemStatus = "completed" if response["status"] == "completed" else "incomplete"
        for event in render.steps(output.close(final, status) if final is not None else [], response["output"]):
            yield frame(event)
    yield frame((_CLOSING[response["status"]], {"response": response}))


@dataclass
class _Rendering:
    """The output items' steps (``app.api.output_items``) as the Responses API's events.
    The closing events carry the items as the stored response has them."""

    message_id: str

    def _where(self, output_index: int) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": output_index, "content_index": 0}

    def steps(self, steps: list[Step], final: list[dict[str, Any]] | None = None) -> list[Event]:
        events: list[Event] = []
        for step in steps:
            events += self._events(step, final or [])
        return events

    def _events(self, step: Step, final: list[dict[str, Any]]) -> list[Event]:
        if isinstance(step, MessageOpened):
            item = {**items.message_item("assistant", "", self.message_id, status="in_progress"), "content": []}
            return [
                ("response.output_item.added", {"output_index": step.output_index, "item": item}),
                ("response.content_part.added", {"part": _EMPTY_PART, **self._where(step.output_index)}),
            ]
        if isinstance(step, TextDelta):
            return [
                ("response.output_text.delta", {"delta": step.delta, "logprobs": [], **self._where(step.output_index)})
            ]
        if isinstance(step, CallOpened):
            item = items.function_call_item(ToolCall(step.call.call_id, step.call.name, ""), status="in_progress")
            return [("response.output_item.added", {"output_index": step.call.output_index, "item": item})]
        if isinstance(step, ArgumentsDelta):
            item_id = items.function_call_item(ToolCall(step.call.call_id, step.call.name, ""))["id"]
            return [
                (
                    "response.function_call_arguments.delta",
                    {"item_id": item_id, "output_index": step.call.output_index, "delta": step.delta},
                )
            ]
        if isinstance(step, MessageClosed):
            done = next((item for item in final if item["type"] == "message"), None) or items.message_item(
                "assistant", step.text, self.message_id, status=step.status
            )
            text = done["content"][0]["text"]
            where = self._where(step.output_index)
            return [
                ("response.output_text.done", {"text": text, "logprobs": [], **where}),
                ("response.content_part.done", {"part": {**_EMPTY_PART, "text": text}, **where}),
                ("response.output_item.done", {"output_index": step.output_index, "item": done}),
            ]
        assert isinstance(step, CallClosed)
        call = step.call
        if step.final is None:
            item = {
                **items.function_call_item(ToolCall(call.call_id, call.name, call.arguments)),
                "status": "incomplete",
            }
            return [("response.output_item.done", {"output_index": call.output_index, "item": item})]
        item = [item for item in final if item["type"] == "function_call"][call.number]
        return [
            (
                "response.function_call_arguments.done",
                {
                    "item_id": item["id"],
                    "output_index": call.output_index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                },
            ),
            ("response.output_item.done", {"output_index": call.output_index, "item": item}),
        ]
