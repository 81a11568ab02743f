"""The Responses API's own refusals, in the OpenAI shape."""

from __future__ import annotations

from app.errors import APIError


def superseded() -> APIError:
    return APIError(409, "The response is no longer the latest of its session.", code="response_superseded")


def previous_response_not_found(response_id: str) -> APIError:
    return APIError(
        400,
        f"Previous response with id {response_id!r} not found.",
        code="previous_response_not_found",
        param="previous_response_id",
    )


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id {response_id!r}.", code="response_not_found", param="response_id")


def conversation_not_found(conversation_id: str) -> APIError:
    return APIError(
        404, f"No conversation with id {conversation_id!r}.", code="conversation_not_found", param="conversation"
    )
