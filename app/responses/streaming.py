"""A response's stream events, as OpenAI sends them over SSE and over its websocket:
created, in_progress, the message item and its text part, text deltas, then the closing
events and ``response.completed`` (``incomplete`` at max_output_tokens or when steered,
``failed`` on an error). Each event carries its ``sequence_number``."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

from app.errors import APIError
from app.responses import items
from app.responses.serving import PendingResponse, ResponsesService
from app.sessions.session import ChunkDelta, ChunkResult

_CLOSING = {"completed": "response.completed", "incomplete": "response.incomplete",
            "cancelled": "response.incomplete", "failed": "response.failed"}


async def sse_frames(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def response_events(service: ResponsesService, owner: str, pending: PendingResponse,
                          numbers: Iterator[int] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """``numbers``: the sequence numbers to use (a websocket numbers its events across responses)."""
    numbers = numbers if numbers is not None else itertools.count()

    def frame(event_type: str, **fields: Any) -> dict[str, Any]:
        return {"type": event_type, "sequence_number": next(numbers), **fields}

    skeleton = service.in_progress(pending).model_dump(mode="json")
    yield frame("response.created", response=skeleton)
    yield frame("response.in_progress", response=skeleton)
    where = {"item_id": pending.message_id, "output_index": 0, "content_index": 0}
    item = {**items.message_item("assistant", "", pending.message_id, status="in_progress"), "content": []}
    yield frame("response.output_item.added", output_index=0, item=item)
    empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield frame("response.content_part.added", part=empty_part, **where)
    result: ChunkResult | None = None
    error: APIError | None = None
    try:
        async with contextlib.aclosing(pending.run.events()) as events:
            async for event in events:
                if isinstance(event, ChunkDelta):
                    if event.text:
                        yield frame("response.output_text.delta", delta=event.text, logprobs=[], **where)
                else:
                    result = event
    except APIError as exc:
        error = exc
    response = (await service.finish(owner, pending, result, error)).model_dump(mode="json")
    if error is not None:
        yield frame("error", code=error.code, message=error.message, param=error.param)
    else:
        done_item = response["output"][0]
        text = done_item["content"][0]["text"]
        yield frame("response.output_text.done", text=text, logprobs=[], **where)
        yield frame("response.content_part.done", part={**empty_part, "text": text}, **where)
        yield frame("response.output_item.done", output_index=0, item=done_item)
    yield frame(_CLOSING[response["status"]], response=response)
