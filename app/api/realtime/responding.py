"""One Realtime response: the chunk's answer as the GA event sequence. No FastAPI here.

Each output item is announced as it starts: the assistant message with its text part
and text deltas, and each function call (a ``function_call`` conversation item, with
``response.function_call_arguments.delta`` events), told apart from text as tokens
arrive by the tool parser's stream. The closing events carry the reply as read whole
(``OutputParser.final``), which is what the conversation keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types import realtime as rt
from pydantic import BaseModel

from app.api.realtime.protocol import new_id
from app.errors import APIError
from app.sessions.chunk import CANCELLED, ChunkDelta, ChunkResult
from app.sessions.run import ChunkRun
from app.tools.parsing import CallDelta, OutputParser


@dataclass
class RealtimeResponse:
    """Streams one response; ``items`` is the conversation's item log, which it extends."""

    run: ChunkRun
    parser: OutputParser
    conversation_id: str
    items: dict[str, Any]
    emit: Callable[[BaseModel], Awaitable[Any]]
    event_id: Callable[[], str]
    response_id: str = field(default_factory=lambda: new_id("resp"))
    message: rt.RealtimeConversationItemAssistantMessage | None = None
    message_index: int = 0
    text: str = ""
    calls: dict[int, tuple[int, rt.RealtimeConversationItemFunctionCall]] = field(default_factory=dict)
    previous: dict[str, str | None] = field(default_factory=dict)  # item id: the item before it
    next_index: int = 0

    async def stream(self) -> None:
        response = rt.RealtimeResponse(id=self.response_id, object="realtime.response", status="in_progress",
                                       output=[], output_modalities=["text"], conversation_id=self.conversation_id)
        await self.emit(rt.ResponseCreatedEvent(type="response.created", event_id=self.event_id(), response=response))
        if not self.parser.parses_calls:  # a reply of text alone: its message opens at once
            await self._open_message()
        result: ChunkResult | None = None
        error: APIError | None = None
        try:
            async with contextlib.aclosing(self.run.events()) as events:
                async for chunk_event in events:
                    if isinstance(chunk_event, ChunkDelta):
                        await self._delta(chunk_event.text, chunk_event.token_ids)
                    else:
                        result = chunk_event
                        await self._delta("", [], finished=True)
        except APIError as exc:
            error = exc
        cancelled = result is not None and result.finish_reason == CANCELLED
        cut = result is not None and result.finish_reason == "length"  # at max_output_tokens
        status: Literal["failed", "cancelled", "incomplete", "completed"] = (
            "failed" if error is not None else "cancelled" if cancelled else "incomplete" if cut else "completed"
        )
        response.status = status
        response.output = await self._close(result, status)
        if error is not None:
            response.status_details = rt.RealtimeResponseStatus(
                type="failed", error={"type": error.type, "code": error.code})
        elif cancelled:
            response.status_details = rt.RealtimeResponseStatus(type="cancelled", reason="client_cancelled")
        elif cut:
            response.status_details = rt.RealtimeResponseStatus(type="incomplete", reason="max_output_tokens")
        if result is not None:
            response.usage = usage_of(result)
        await self.emit(rt.ResponseDoneEvent(type="response.done", event_id=self.event_id(), response=response))

    # ------------------------------------------------------------------ items as they start
    async def _added(self, item: Any, output_index: int) -> None:
        self.previous[item.id] = next(reversed(self.items), None)
        self.items[item.id] = item
        await self.emit(rt.ResponseOutputItemAddedEvent(type="response.output_item.added", event_id=self.event_id(),
                                                        response_id=self.response_id, output_index=output_index,
                                                        item=item))
        await self.emit(rt.ConversationItemAdded(type="conversation.item.added", event_id=self.event_id(),
                                                 item=item, previous_item_id=self.previous[item.id]))

    def _text_ids(self) -> dict[str, Any]:
        assert self.message is not None and self.message.id is not None
        return {"response_id": self.response_id, "item_id": self.message.id, "output_index": self.message_index,
                "content_index": 0}

    async def _open_message(self) -> None:
        self.message = rt.RealtimeConversationItemAssistantMessage(
            id=new_id("item"), type="message", role="assistant", object="realtime.item", status="in_progress",
            content=[])
        self.message_index, self.next_index = self.next_index, self.next_index + 1
        await self._added(self.message, self.message_index)
        await self.emit(rt.ResponseContentPartAddedEvent(
            type="response.content_part.added", event_id=self.event_id(), part={"type": "text", "text": ""},
            **self._text_ids()))

    async def _delta(self, text: str, token_ids: list[int], finished: bool = False) -> None:
        parsed = self.parser.feed(text, token_ids, finished)
        if parsed.text:
            if self.message is None:
                await self._open_message()
            self.text += parsed.text
            await self.emit(rt.ResponseTextDeltaEvent(type="response.output_text.delta", event_id=self.event_id(),
                                                      delta=parsed.text, **self._text_ids()))
        for call in parsed.calls:
            await self._call_delta(call)

    async def _call_delta(self, delta: CallDelta) -> None:
        if delta.index not in self.calls:
            if not delta.name:
                return  # arguments before a name: vLLM's parsers send none
            item = rt.RealtimeConversationItemFunctionCall(
                type="function_call", id=new_id("item"), call_id=self.parser.call_id(delta.index), name=delta.name,
                arguments="", object="realtime.item", status="in_progress")
            self.calls[delta.index] = (self.next_index, item)
            self.next_index += 1
            await self._added(item, self.calls[delta.index][0])
        index, item = self.calls[delta.index]
        if delta.arguments:
            item.arguments += delta.arguments
            await self.emit(rt.ResponseFunctionCallArgumentsDeltaEvent(
                type="response.function_call_arguments.delta", event_id=self.event_id(),
                response_id=self.response_id, item_id=item.id or "", output_index=index, call_id=item.call_id or "",
                delta=delta.arguments))

    # ------------------------------------------------------------------ items as they end
    async def _close(self, result: ChunkResult | None, status: str) -> list[Any]:
        """Each item's closing events, as the reply reads whole: a call streamed but not
        in the final reading (its JSON did not parse) ends incomplete."""
        final = self.parser.final(result.text, result.token_ids) if result is not None else None
        item_status: Literal["completed", "incomplete"] = "completed" if status == "completed" else "incomplete"
        if final is not None and (final.text or not final.calls) and self.message is None:
            await self._open_message()
        output: list[Any] = []
        if self.message is not None:
            text = final.text if final is not None else self.text
            await self.emit(rt.ResponseTextDoneEvent(type="response.output_text.done", event_id=self.event_id(),
                                                     text=text, **self._text_ids()))
            await self.emit(rt.ResponseContentPartDoneEvent(
                type="response.content_part.done", event_id=self.event_id(), part={"type": "text", "text": text},
                **self._text_ids()))
            self.message.status = item_status
            self.message.content = [rt.realtime_conversation_item_assistant_message.Content(
                type="output_text", text=text)]
            output.append(await self._done(self.message, self.message_index))
        calls = final.calls if final is not None else []
        for number, call in enumerate(calls):
            if number not in self.calls:
                await self._call_delta(CallDelta(number, call.name))
            index, item = self.calls[number]
            item.arguments, item.status = call.arguments, item_status
            await self.emit(rt.ResponseFunctionCallArgumentsDoneEvent(
                type="response.function_call_arguments.done", event_id=self.event_id(),
                response_id=self.response_id, item_id=item.id or "", output_index=index, call_id=call.call_id,
                name=call.name, arguments=call.arguments))
            output.append(await self._done(item, index))
        for number, (index, item) in self.calls.items():
            if number >= len(calls):
                item.status = "incomplete"
                output.append(await self._done(item, index))
        return output

    async def _done(self, item: Any, output_index: int) -> Any:
        await self.emit(rt.ResponseOutputItemDoneEvent(type="response.output_item.done", event_id=self.event_id(),
                                                       response_id=self.response_id, output_index=output_index,
                                                       item=item))
        await self.emit(rt.ConversationItemDone(type="conversation.item.done", event_id=self.event_id(),
                                                item=item, previous_item_id=self.previous[item.id]))
        return item


def usage_of(result: ChunkResult) -> rt.RealtimeResponseUsage:
    """GA usage, with our split of the prompt as extra input_token_details fields."""
    usage, details = result.usage, result.usage.prompt_tokens_details
    input_details = rt.RealtimeResponseUsageInputTokenDetails(
        cached_tokens=details.cached_tokens, text_tokens=usage.prompt_tokens,
        device_tokens=details.device_tokens, cpu_tier_tokens=details.cpu_tier_tokens,
        disk_tier_tokens=details.disk_tier_tokens, computed_tokens=details.computed_tokens,
    )
    return rt.RealtimeResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        input_token_details=input_details,
        output_token_details=rt.RealtimeResponseUsageOutputTokenDetails(text_tokens=usage.completion_tokens),
    )
