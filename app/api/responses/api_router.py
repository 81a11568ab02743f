"""Thin routes of the Responses API (``/v1/responses``), in place of vLLM's.

A response that is stored (OpenAI's default), continues a ``previous_response_id``, is
added to a ``conversation`` or warms a session up (``generate: false``) runs on a
session (``serving``). A stateless one (``store: false`` and none of these) goes to
vLLM's own handler, unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.openai.responses import api_router as vllm_responses

from app.api.deps import LimitsDep, OwnerDep, ResponsesDep, RouteKeyDep
from app.api.responses.protocol import ResponsesCreateRequest
from app.api.responses.streaming import response_events, sse_frames
from app.api.responses.websocket import ResponsesConnection
from app.errors import APIError, OpenAIErrorBody
from app.http.disconnect import unless_disconnected
from app.http.errors import vllm_answer
from app.http.sse import EventStream

router = APIRouter(tags=["responses"])

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "model": OpenAIErrorBody}
    for status, description in {
        400: "Invalid request",
        404: "Unknown response or conversation",
        409: "The conversation is answering another response",
    }.items()
}


@router.post("/v1/responses", responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def create_response(
    body: ResponsesCreateRequest, request: Request, service: ResponsesDep, owner: OwnerDep, route_key: RouteKeyDep
) -> Response:
    """Create a model response. Stored responses, ``previous_response_id`` and
    ``conversation`` run on sessions: each turn computes only its new input."""
    if body.store is False and body.previous_response_id is None and body.conversation is None and body.generate:
        return await vllm_answer(vllm_responses.create_responses(body, request), request)
    pending = await service.start(owner, body, route_key=route_key)
    if body.stream:
        return EventStream(sse_frames(response_events(service, owner, pending)))
    result = await unless_disconnected(request.receive, pending.run)
    response = service.finish(pending, result, None)
    return Response(response.model_dump_json(), media_type="application/json")


@router.websocket("/v1/responses")
async def responses_websocket(
    websocket: WebSocket, service: ResponsesDep, limits: LimitsDep, owner: OwnerDep, route_key: RouteKeyDep
) -> None:
    """The Responses API over a websocket (``client.responses.connect()``)."""
    await websocket.accept()
    await ResponsesConnection(websocket, service, limits, owner, route_key).run()


@router.get("/v1/responses/{response_id}", responses=ERRORS)
async def retrieve_response(response_id: str, service: ResponsesDep, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await service.retrieve(owner, response_id))


@router.delete("/v1/responses/{response_id}", responses=ERRORS)
async def delete_response(response_id: str, service: ResponsesDep, owner: OwnerDep) -> JSONResponse:
    return JSONResponse(await service.delete(owner, response_id))


@router.post("/v1/responses/{response_id}/cancel", responses=ERRORS)
async def cancel_response(response_id: str, service: ResponsesDep, owner: OwnerDep) -> JSONResponse:
    await service.retrieve(owner, response_id)  # 404 for an unknown one
    raise APIError(
        400,
        "Only background responses can be cancelled, and this server runs none.",
        code="invalid_request",
        param="response_id",
    )


@router.get("/v1/responses/{response_id}/input_items", responses=ERRORS)
async def list_input_items(
    response_id: str,
    service: ResponsesDep,
    owner: OwnerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    return JSONResponse(page(await service.input_items(owner, response_id), after, limit, order))


def page(data: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's list object: ``limit`` items after the one with id ``after``, in ``order``."""
    ordered = data if order == "asc" else data[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"No item with id {after!r} in this list.", code="invalid_value", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    shown = ordered[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(ordered) > limit,
    }
