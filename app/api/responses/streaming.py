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
from dataclasses import dataclass, field
from typing import Any

from app.api.responses import items
from app.api.responses.serving import PendingResponse, ResponsesService
from app.errors import APIError
from app.sessions.chunk import ChunkDelta, ChunkResult
from app.tools.parsing import CallDelta, ToolCall

_CLOSING = {"completed": "response.completed", "incomplete": "response.incomplete",
            "cancelled": "response.incomplete", "failed": "response.failed"}
_EMPTY_PART = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
Event = tuple[str, dict[str, Any]]


async def sse_frames(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def response_events(service: ResponsesService, owner: str, pending: PendingResponse,
                          numbers: Iterator[int] | None = None) -> AsyncGenerator[dict[str, Any], None]:
    """``numbers``: the sequence numbers to use (a websocket numbers its events across responses)."""
    numbers = numbers if numbers is not None else itertools.count()

    def frame(event: Event) -> dict[str, Any]:
        return {"type": event[0], "sequence_number": next(numbers), **event[1]}

    skeleton = service.in_progress(pending).model_dump(mode="json")
    yield frame(("response.created", {"response": skeleton}))
    yield frame(("response.in_progress", {"response": skeleton}))
    output = _OutputStream(pending)
    if not pending.parser.parses_calls and pending.request.generate:  # text alone: its message opens at once
        for event in output.open_message():
            yield frame(event)
    result: ChunkResult | None = None
    error: APIError | None = None
    try:
        async with contextlib.aclosing(pending.run.events()) as events:
            async for chunk_event in events:
                if isinstance(chunk_event, ChunkDelta):
                    for event in output.delta(chunk_event.text, chunk_event.token_ids):
                        yield frame(event)
                else:
                    result = chunk_event
                    for event in output.delta("", [], finished=True):
                        yield frame(event)
    except APIError as exc:
        error = exc
    response = service.finish(pending, result, error).model_dump(mode="json")
    if error is not None:
        yield frame(("error", {"code": error.code, "message": error.message, "param": error.param}))
    else:
        for event in output.close(response["output"]):
            yield frame(event)
    yield frame((_CLOSING[response["status"]], {"response": response}))


@dataclass
class _StreamedCall:
    output_index: int
    item: dict[str, Any]
    arguments: str = ""


@dataclass
class _OutputStream:
    """The output items a stream has announced, each at its output index."""

    pending: PendingResponse
    next_index: int = 0
    message_index: int | None = None
    text: str = ""
    calls: dict[int, _StreamedCall] = field(default_factory=dict)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.pending.message_id, "output_index": self.message_index, "content_index": 0}

    def open_message(self) -> list[Event]:
        self.message_index, self.next_index = self.next_index, self.next_index + 1
        item = {**items.message_item("assistant", "", self.pending.message_id, status="in_progress"), "content": []}
        return [("response.output_item.added", {"output_index": self.message_index, "item": item}),
                ("response.content_part.added", {"part": _EMPTY_PART, **self._where()})]

    def delta(self, text: str, token_ids: list[int], finished: bool = False) -> list[Event]:
        parsed = self.pending.parser.feed(text, token_ids, finished)
        events: list[Event] = []
        if parsed.text:
            if self.message_index is None:
                events += self.open_message()
            self.text += parsed.text
            events.append(("response.output_text.delta", {"delta": parsed.text, "logprobs": [], **self._where()}))
        for call in parsed.calls:
            events += self._call_delta(call)
        return events

    def _call_delta(self, delta: CallDelta) -> list[Event]:
        events: list[Event] = []
        streamed = self.calls.get(delta.index)
        if streamed is None:
            if not delta.name:
                return events  # arguments before a name: vLLM's parsers send none
            call = ToolCall(self.pending.parser.call_id(delta.index), delta.name, "")
            streamed = self.calls[delta.index] = _StreamedCall(
                self.next_index, items.function_call_item(call, status="in_progress"))
            self.next_index += 1
            events.append(("response.output_item.added", {"output_index": streamed.output_index,
                                                          "item": streamed.item}))
        if delta.arguments:
            streamed.arguments += delta.arguments
            events.append(("response.function_call_arguments.delta", {
                "item_id": streamed.item["id"], "output_index": streamed.output_index, "delta": delta.arguments}))
        return events

    def close(self, final: list[dict[str, Any]]) -> list[Event]:
        """Each item's closing events, as the reply reads whole: a call streamed but not
        in the final reading (its JSON did not parse) ends incomplete."""
        events: list[Event] = []
        messages = [item for item in final if item["type"] == "message"]
        if messages or self.message_index is not None:
            if self.message_index is None:
                events += self.open_message()
            done = messages[0] if messages else \
                items.message_item("assistant", self.text, self.pending.message_id, status="incomplete")
            text = done["content"][0]["text"]
            events += [("response.output_text.done", {"text": text, "logprobs": [], **self._where()}),
                       ("response.content_part.done", {"part": {**_EMPTY_PART, "text": text}, **self._where()}),
                       ("response.output_item.done", {"output_index": self.message_index, "item": done})]
        calls = [item for item in final if item["type"] == "function_call"]
        for index, item in enumerate(calls):
            if index not in self.calls:
                events += self._call_delta(CallDelta(index, item["name"]))
            streamed = self.calls[index]
            events += [("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": streamed.output_index, "name": item["name"],
                "arguments": item["arguments"]}),
                ("response.output_item.done", {"output_index": streamed.output_index, "item": item})]
        for index, streamed in self.calls.items():
            if index >= len(calls):
                item = {**streamed.item, "arguments": streamed.arguments, "status": "incomplete"}
                events.append(("response.output_item.done", {"output_index": streamed.output_index, "item": item}))
        return events
