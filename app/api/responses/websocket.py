"""The Responses API over a websocket (the SDK's ``client.responses.connect()``):
OpenAI's own streaming-input protocol, on sessions.

Each ``response.create`` carries the create body (no ``stream``, ``background``); turns
of one lane (``stream_id``; none is a lane too) run one after another, in order, each
sending only its new input, and lanes run side by side: ``stream_id`` routes,
``previous_response_id`` names the lineage, so a new lane can fork from a response made
on another. ``generate: false``
warms the session up with its input (computed, nothing generated), so that the turn
continuing it computes only what is new. The connection keeps each lane's latest
response, so ``store: false`` still chains on it. ``response.steer`` pushes
user input into the running response: it stops at its next token (the session keeps
what it generated), ends ``incomplete`` with reason ``steered``, and a successor with
the same settings continues from it with the steered input, as the next chunk. Steered
input that arrives as a response ends normally starts the successor all the same.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import WebSocket
from pydantic import ValidationError

from app.api.responses import items
from app.api.responses.protocol import ResponsesCreateRequest
from app.api.responses.serving import ContextPoint, PendingResponse, ResponsesService
from app.api.responses.streaming import response_events
from app.errors import APIError, error_param, most_specific
from app.http.websocket import EventConnection, Worker
from app.limits import KeyLimits

# What a websocket's response.create may not carry (its transport decides them).
_NOT_ON_A_SOCKET = ("stream", "background")
# Lanes one connection may open: each is a task and a queue, so they are bounded.
MAX_LANES = 16


@dataclass
class _Lane:
    """One ``stream_id``'s turns, run in order by a worker of its own."""

    stream_id: str | None
    worker: Worker[ResponsesCreateRequest]
    current: PendingResponse | None = None
    steered: list[dict[str, Any]] = field(default_factory=list)  # input for the current response's successor
    latest: str | None = None  # the id of the lane's latest response


class ResponsesConnection(EventConnection):
    def __init__(
        self,
        websocket: WebSocket,
        service: ResponsesService,
        limits: KeyLimits,
        owner: str,
        route_key: str | None = None,
    ) -> None:
        super().__init__(websocket, limits, owner)
        self.service = service
        self.route_key = route_key  # the proxy's, for the chains this connection starts
        self.numbers = itertools.count()
        self.lanes: dict[str | None, _Lane] = {}
        self.latest: dict[str, ContextPoint] = {}  # each lane's latest response, stored or not

    async def send_event(self, event: dict[str, Any], stream_id: str | None = None) -> None:
        if stream_id is not None:
            event["stream_id"] = stream_id
        await self.send(json.dumps(event))

    def about(self, event: Any) -> str | None:
        return None  # an event refused before it reaches a lane is answered on none

    def error_frame(self, error: APIError, about: str | None) -> str:
        event = {
            "type": "error",
            "sequence_number": next(self.numbers),
            "status": error.status,
            "error": {"type": error.type, "code": error.code, "message": error.message, "param": error.param},
        }
        if about is not None:
            event["stream_id"] = about
        return json.dumps(event)

    async def receive(self, event: Any) -> None:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "response.create":
            stream_id = event.get("stream_id")
            if stream_id is not None and not isinstance(stream_id, str):
                raise APIError(400, "stream_id is a string.", code="invalid_type", param="stream_id")
            body = {key: value for key, value in event.items() if key not in ("type", "stream_id")}
            if refused := [name for name in _NOT_ON_A_SOCKET if body.get(name)]:
                raise APIError(
                    400,
                    f"{refused[0]} is not available over the websocket.",
                    code="unsupported_parameter",
                    param=refused[0],
                )
            try:
                request = ResponsesCreateRequest.model_validate(body)
            except ValidationError as invalid:
                first = most_specific(invalid.errors())
                raise APIError(
                    400,
                    f"Invalid response.create: {first['msg']}.",
                    code="invalid_request",
                    param=error_param(first["loc"]),
                ) from None
            self._lane(stream_id).worker.submit(request)
        elif kind == "response.steer":
            await self.steer(event)
        else:
            raise APIError(
                400,
                f"Unknown client event type {kind!r}: send response.create or response.steer.",
                code="invalid_event",
                param="type",
            )

    def _lane(self, stream_id: str | None) -> _Lane:
        lane = self.lanes.get(stream_id)
        if lane is None:
            if len(self.lanes) >= MAX_LANES:
                raise APIError(
                    400,
                    f"A connection runs at most {MAX_LANES} lanes (stream_id values).",
                    code="too_many_streams",
                    param="stream_id",
                )

            async def serve_turns(turn: ResponsesCreateRequest | None) -> None:
                while turn is not None:  # a steered response's successor follows it at once
                    turn = await self._respond(self.lanes[stream_id], turn)

            async def failed(turn: ResponsesCreateRequest, error: APIError) -> None:
                await self.send_error(error, stream_id)

            lane = self.lanes[stream_id] = _Lane(
                stream_id, self.worker(serve_turns, failed, f"responses-ws-{stream_id}")
            )
        return lane

    async def _respond(self, lane: _Lane, request: ResponsesCreateRequest) -> ResponsesCreateRequest | None:
        try:
            pending = await self.service.start(self.owner, request, self.latest, self.route_key)
        except APIError as error:
            await self.send_error(error, lane.stream_id)
            return None
        lane.current, lane.steered = pending, []
        try:
            events = response_events(self.service, self.owner, pending, self.numbers)
            async with contextlib.aclosing(events):
                async for event in events:
                    await self.send_event(event, lane.stream_id)
        finally:
            lane.current = None
        if pending.point is not None:
            self.latest.pop(lane.latest or "", None)
            lane.latest, self.latest[pending.id] = pending.id, pending.point
        if not lane.steered or pending.point is None:
            return None
        # The successor: the same settings, continuing the steered response with the steered input.
        return request.model_copy(
            update={"input": lane.steered, "previous_response_id": pending.id, "conversation": None, "generate": True}
        )

    async def steer(self, event: dict[str, Any]) -> None:
        steer_id = items.new_id("steer")
        previous = event.get("previous_response_id")
        lane = next(
            (lane for lane in self.lanes.values() if lane.current is not None and lane.current.id == previous), None
        )
        stream_id = lane.stream_id if lane is not None else None

        async def failed(code: str, message: str) -> None:
            await self.send_event(
                {
                    "type": "response.steer.failed",
                    "sequence_number": next(self.numbers),
                    "error": {"type": "invalid_request_error", "code": code, "message": message},
                    "steer": {"id": steer_id, "previous_response_id": previous, "input": event.get("input")},
                },
                stream_id,
            )

        if lane is None or lane.current is None:
            ended = previous in self.latest
            await failed(
                "response_already_completed" if ended else "response_not_active",
                f"Response {previous!r} is not running on this connection.",
            )
            return
        current = lane.current
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
        lane.steered.extend(steered)
        current.steered = True
        current.run.stop()  # at its next token; the session keeps what it generated
        await self.send_event(
            {
                "type": "response.steer.accepted",
                "sequence_number": next(self.numbers),
                "steer": {"id": steer_id, "previous_response_id": previous},
            },
            stream_id,
        )
