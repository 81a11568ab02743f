"""The Responses API over a websocket (the SDK's ``client.responses.connect()``):
OpenAI's own streaming-input protocol, on sessions.

Each ``response.create`` carries the create body (no ``stream``, ``background``); turns
run one after another, in order, each sending only its new input; ``generate: false``
warms the session up with its input (computed, nothing generated), so that the turn
continuing it computes only what is new. The connection keeps its latest response, so
``store: false`` still chains on it. ``response.steer`` pushes
user input into the running response: it stops at its next token (the session keeps
what it generated), ends ``incomplete`` with reason ``steered``, and a successor with
the same settings continues from it with the steered input, as the next chunk. Steered
input that arrives as a response ends normally starts the successor all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

from fastapi import WebSocket
from pydantic import ValidationError

from app.errors import APIError, error_param
from app.responses import items
from app.responses.protocol import ResponsesCreateRequest
from app.responses.serving import ContextPoint, PendingResponse, ResponsesService
from app.responses.streaming import response_events
from app.transport.websocket import EventChannel

# What a websocket's response.create may not carry (its transport decides them).
_NOT_ON_A_SOCKET = ("stream", "background")


class ResponsesConnection:
    def __init__(self, websocket: WebSocket, service: ResponsesService, owner: str) -> None:
        self.service, self.owner = service, owner
        self.channel = EventChannel(websocket, service.sessions.limits, owner, self._refuse)
        self.numbers = itertools.count()
        self.turns: asyncio.Queue[tuple[ResponsesCreateRequest, str | None]] = asyncio.Queue()
        self.current: PendingResponse | None = None
        self.steered: list[dict[str, Any]] = []  # accepted input for the current response's successor
        self.latest: dict[str, ContextPoint] = {}  # the connection's latest response, stored or not

    async def send(self, event: dict[str, Any], stream_id: str | None = None) -> None:
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.channel.send_text(json.dumps(event))

    async def send_error(self, error: APIError, stream_id: str | None = None) -> None:
        await self.send({"type": "error", "sequence_number": next(self.numbers), "status": error.status,
                         "error": {"type": error.type, "code": error.code, "message": error.message,
                                   "param": error.param}}, stream_id)

    async def _refuse(self, error: APIError) -> None:
        await self.send_error(error)

    async def run(self) -> None:
        worker = asyncio.create_task(self._serve_turns(), name=f"responses-ws-{self.channel.connection_id}")
        try:
            async for raw in self.channel.frames():
                try:
                    await self.handle(raw)
                except APIError as error:
                    await self.send_error(error)
        finally:
            # The client left: a running response is cancelled and its chunk undone.
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker

    async def handle(self, raw: str) -> None:
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):
            raise APIError(400, "A client event is a JSON object.", code="invalid_json") from None
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            body = {key: value for key, value in event.items() if key not in ("type", "stream_id")}
            if refused := [name for name in _NOT_ON_A_SOCKET if body.get(name)]:
                raise APIError(400, f"{refused[0]} is not available over the websocket.",
                               code="unsupported_parameter", param=refused[0])
            try:
                request = ResponsesCreateRequest.model_validate(body)
            except ValidationError as invalid:
                first = invalid.errors()[0]
                raise APIError(400, f"Invalid response.create: {first['msg']}.", code="invalid_request",
                               param=error_param(first["loc"])) from None
            self.turns.put_nowait((request, event.get("stream_id")))
        elif kind == "response.steer":
            await self.steer(event)
        else:
            raise APIError(400, f"Unknown client event type {kind!r}: send response.create or response.steer.",
                           code="invalid_event", param="type")

    async def _serve_turns(self) -> None:
        while True:
            request, stream_id = await self.turns.get()
            turn: ResponsesCreateRequest | None = request
            while turn is not None:  # a steered response's successor follows it at once
                turn = await self._respond(turn, stream_id)

    async def _respond(self, request: ResponsesCreateRequest, stream_id: str | None) -> ResponsesCreateRequest | None:
        try:
            pending = await self.service.start(self.owner, request, self.latest)
        except APIError as error:
            await self.send_error(error, stream_id)
            return None
        self.current, self.steered = pending, []
        try:
            events = response_events(self.service, self.owner, pending, self.numbers)
            async with contextlib.aclosing(events):
                async for event in events:
                    await self.send(event, stream_id)
        finally:
            self.current = None
        if pending.point is not None:
            self.latest = {pending.id: pending.point}
        if not self.steered or pending.point is None:
            return None
        # The successor: the same settings, continuing the steered response with the steered input.
        return request.model_copy(update={"input": self.steered, "previous_response_id": pending.id,
                                          "conversation": None, "generate": True})

    async def steer(self, event: dict[str, Any]) -> None:
        steer_id = items.new_id("steer")
        previous = event.get("previous_response_id")
        current = self.current

        async def failed(code: str, message: str) -> None:
            await self.send({"type": "response.steer.failed", "sequence_number": next(self.numbers),
                             "error": {"type": "invalid_request_error", "code": code, "message": message},
                             "steer": {"id": steer_id, "previous_response_id": previous, "input": event.get("input")}})

        if current is None or current.id != previous:
            ended = previous in self.latest
            await failed("response_already_completed" if ended else "response_not_active",
                         f"Response {previous!r} is not running on this connection.")
            return
        if current.request.conversation is not None:
            await failed("steering_not_supported", "Responses bound to a conversation cannot be steered.")
            return
        try:
            steered = items.input_items(event.get("input"))
        except APIError as error:
            await failed("invalid_input", error.message)
            return
        if not steered or any(item["role"] != "user" for item in steered):
            await failed("invalid_input", "Steering input is one or more user messages.")
            return
        self.steered.extend(steered)
        current.steered = True
        current.run.stop()  # at its next token; the session keeps what it generated
        await self.send({"type": "response.steer.accepted", "sequence_number": next(self.numbers),
                         "steer": {"id": steer_id, "previous_response_id": previous}})
