"""One Realtime response: the chunk's answer as the GA event sequence. No FastAPI here.

The output items are the shared state machine's (``app.api.output_items``), rendered
here: the assistant message with its text part and text deltas, each function call a
``function_call`` conversation item with ``response.function_call_arguments.delta``
events; each item is also a conversation item (``conversation.item.added`` and
``.done``), kept in the conversation's item log.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types import realtime as rt
from pydantic import BaseModel

from app.api.output_items import (
    ArgumentsDelta,
    CallOpened,
    MessageClosed,
    MessageOpened,
    OutputItems,
    Step,
    TextDelta,
)
from app.api.realtime.protocol import new_id
from app.errors import APIError
from app.sessions.chunk import CANCELLED, ChunkDelta, ChunkResult
from app.sessions.run import ChunkRun
from app.tools.parsing import OutputParser


@dataclass
class RealtimeResponse:
    """Streams one response; ``items`` is the conversation's item log, which it extends.
    Its output items are ``app.api.output_items``' steps, rendered as GA events."""

    run: ChunkRun
    parser: OutputParser
    conversation_id: str
    items: dict[str, Any]
    emit: Callable[[BaseModel], Awaitable[Any]]
    event_id: Callable[[], str]
    response_id: str = field(default_factory=lambda: new_id("resp"))
    message: rt.RealtimeConversationItemAssistantMessage | None = None
    calls: dict[int, rt.RealtimeConversationItemFunctionCall] = field(default_factory=dict)  # by call number
    previous: dict[str, str | None] = field(default_factory=dict)  # item id: the item before it
    output: list[Any] = field(default_factory=list)  # the items as they close

    async def stream(self) -> None:
        response = rt.RealtimeResponse(
            id=self.response_id,
            object="realtime.response",
            status="in_progress",
            output=[],
            output_modalities=["text"],
            conversation_id=self.conversation_id,
        )
        await self.emit(rt.ResponseCreatedEvent(type="response.created", event_id=self.event_id(), response=response))
        output = OutputItems(self.parser)
        await self._render(output.start())
        result: ChunkResult | None = None
        error: APIError | None = None
        try:
            async with contextlib.aclosing(self.run.events()) as events:
                async for chunk_event in events:
                    if isinstance(chunk_event, ChunkDelta):
                        await self._render(output.feed(chunk_event.text, chunk_event.token_ids))
                    else:
                        result = chunk_event
                        await self._render(output.feed("", [], finished=True))
        except APIError as exc:
            error = exc
        cancelled = result is not None and result.finish_reason == CANCELLED
        cut = result is not None and result.finish_reason == "length"  # at max_output_tokens
        status: Literal["failed", "cancelled", "incomplete", "completed"] = (
            "failed" if error is not None else "cancelled" if cancelled else "incomplete" if cut else "completed"
        )
        response.status = status
        final = self.parser.final(result.text, result.token_ids) if result is not None else None
        await self._render(output.close(final, "completed" if status == "completed" else "incomplete"))
        response.output = self.output
        if error is not None:
            response.status_details = rt.RealtimeResponseStatus(
                type="failed", error={"type": error.type, "code": error.code}
            )
        elif cancelled:
            response.status_details = rt.RealtimeResponseStatus(type="cancelled", reason="client_cancelled")
        elif cut:
            response.status_details = rt.RealtimeResponseStatus(type="incomplete", reason="max_output_tokens")
        if result is not None:
            response.usage = usage_of(result)
        await self.emit(rt.ResponseDoneEvent(type="response.done", event_id=self.event_id(), response=response))

    async def _render(self, steps: list[Step]) -> None:
        for step in steps:
            await self._step(step)

    async def _step(self, step: Step) -> None:
        if isinstance(step, MessageOpened):
            self.message = rt.RealtimeConversationItemAssistantMessage(
                id=new_id("item"),
                type="message",
                role="assistant",
                object="realtime.item",
                status="in_progress",
                content=[],
            )
            await self._added(self.message, step.output_index)
            await self.emit(
                rt.ResponseContentPartAddedEvent(
                    type="response.content_part.added",
                    event_id=self.event_id(),
                    part={"type": "text", "text": ""},
                    **self._text_ids(step.output_index),
                )
            )
        elif isinstance(step, TextDelta):
            await self.emit(
                rt.ResponseTextDeltaEvent(
                    type="response.output_text.delta",
                    event_id=self.event_id(),
                    delta=step.delta,
                    **self._text_ids(step.output_index),
                )
            )
        elif isinstance(step, CallOpened):
            item = self.calls[step.call.number] = rt.RealtimeConversationItemFunctionCall(
                type="function_call",
                id=new_id("item"),
                call_id=step.call.call_id,
                name=step.call.name,
                arguments="",
                object="realtime.item",
                status="in_progress",
            )
            await self._added(item, step.call.output_index)
        elif isinstance(step, ArgumentsDelta):
            item = self.calls[step.call.number]
            item.arguments += step.delta
            await self.emit(
                rt.ResponseFunctionCallArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta",
                    event_id=self.event_id(),
                    response_id=self.response_id,
                    item_id=item.id or "",
                    output_index=step.call.output_index,
                    call_id=item.call_id or "",
                    delta=step.delta,
                )
            )
        elif isinstance(step, MessageClosed):
            assert self.message is not None
            await self.emit(
                rt.ResponseTextDoneEvent(
                    type="response.output_text.done",
                    event_id=self.event_id(),
                    text=step.text,
                    **self._text_ids(step.output_index),
                )
            )
            await self.emit(
                rt.ResponseContentPartDoneEvent(
                    type="response.content_part.done",
                    event_id=self.event_id(),
                    part={"type": "text", "text": step.text},
                    **self._text_ids(step.output_index),
                )
            )
            self.message.status = step.status
            self.message.content = [
                rt.realtime_conversation_item_assistant_message.Content(type="output_text", text=step.text)
            ]
            await self._done(self.message, step.output_index)
        else:
            item = self.calls[step.call.number]
            item.status = step.status
            if step.final is not None:
                item.arguments = step.final.arguments
                await self.emit(
                    rt.ResponseFunctionCallArgumentsDoneEvent(
                        type="response.function_call_arguments.done",
                        event_id=self.event_id(),
                        response_id=self.response_id,
                        item_id=item.id or "",
                        output_index=step.call.output_index,
                        call_id=step.final.call_id,
                        name=step.final.name,
                        arguments=step.final.arguments,
                    )
                )
            await self._done(item, step.call.output_index)

    async def _added(self, item: Any, output_index: int) -> None:
        self.previous[item.id] = next(reversed(self.items), None)
        self.items[item.id] = item
        await self.emit(
            rt.ResponseOutputItemAddedEvent(
                type="response.output_item.added",
                event_id=self.event_id(),
                response_id=self.response_id,
                output_index=output_index,
                item=item,
            )
        )
        await self.emit(
            rt.ConversationItemAdded(
                type="conversation.item.added",
                event_id=self.event_id(),
                item=item,
                previous_item_id=self.previous[item.id],
            )
        )

    def _text_ids(self, output_index: int) -> dict[str, Any]:
        assert self.message is not None and self.message.id is not None
        return {
            "response_id": self.response_id,
            "item_id": self.message.id,
            "output_index": output_index,
            "content_index": 0,
        }

    async def _done(self, item: Any, output_index: int) -> None:
        await self.emit(
            rt.ResponseOutputItemDoneEvent(
                type="response.output_item.done",
                event_id=self.event_id(),
                response_id=self.response_id,
                output_index=output_index,
                item=item,
            )
        )
        await self.emit(
            rt.ConversationItemDone(
                type="conversation.item.done",
                event_id=self.event_id(),
                item=item,
                previous_item_id=self.previous[item.id],
            )
        )
        self.output.append(item)


def usage_of(result: ChunkResult) -> rt.RealtimeResponseUsage:
    """GA usage, with our split of the prompt as extra input_token_details fields."""
    usage, details = result.usage, result.usage.prompt_tokens_details
    input_details = rt.RealtimeResponseUsageInputTokenDetails(
        cached_tokens=details.cached_tokens,
        text_tokens=usage.prompt_tokens,
        device_tokens=details.device_tokens,
        cpu_tier_tokens=details.cpu_tier_tokens,
        disk_tier_tokens=details.disk_tier_tokens,
        computed_tokens=details.computed_tokens,
    )
    return rt.RealtimeResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_token_details=input_details,
        output_token_details=rt.RealtimeResponseUsageOutputTokenDetails(text_tokens=usage.completion_tokens),
    )
