"""The OpenAI error shape, in one place for REST, SSE and websocket alike.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``.
No web framework here (session logic raises these); ``app.http.errors`` sends them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel


class OpenAIErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """Every error this app sends, in the OpenAI shape."""

    error: OpenAIErrorInfo


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        event_id: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.type = type or _default_type(status)
        self.param = param
        self.headers = headers  # e.g. Retry-After on 429 and 503
        self.event_id = event_id  # on a websocket: the client event it answers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 409:
        return "conflict_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- common errors ------------------------------------------------------------


def session_not_found(session_id: str) -> APIError:
    return APIError(404, f"No session with id {session_id!r}.", code="session_not_found", param="session_id")


def internal_error() -> APIError:
    """A bug (ours or vLLM's): the OpenAI shape, and no detail that could carry request text."""
    return APIError(500, "The server failed on this request.", code="internal_error")


def unauthorized(message: str = "Missing or invalid API key.") -> APIError:
    return APIError(401, message, code="invalid_api_key")


# The part of the request FastAPI's validation errors name first.
REQUEST_PARTS = ("body", "query", "path", "header")
_FIELD_NAME = re.compile(r"[a-z_][A-Za-z0-9_]*|[0-9]+")


def error_param(loc: Any) -> str | None:
    """A validation error's location as a parameter path (``input``,
    ``session.max_tokens``): pydantic's union branch tags (``constrained-str``,
    ``list[int]``, ``InputAppendEvent``) and the request part (``body``) are noise."""
    parts = [str(part) for part in loc or ()]
    if parts and parts[0] in REQUEST_PARTS:
        parts = parts[1:]
    return ".".join(part for part in parts if _FIELD_NAME.fullmatch(part)) or None


def most_specific(errors: Sequence[Any]) -> Any:
    """The error of a validation's list to report: the deepest. A value that fits no
    branch of a union gets one error per branch, and the deepest is in the branch the
    client meant (a chat message without content, not "should be a valid string");
    between errors as deep, the one in the branch with the fewest errors (a completion
    body sent to a route that takes a chat or a completion is a completion)."""

    def branch(error: Any) -> str | None:
        loc = [str(part) for part in (error.get("loc") or () if isinstance(error, dict) else ())]
        if loc and loc[0] in REQUEST_PARTS:
            loc = loc[1:]
        return loc[0] if loc and not _FIELD_NAME.fullmatch(loc[0]) else None

    per_branch = Counter(branch(error) for error in errors)
    return max(
        errors,
        key=lambda error: (len(error.get("loc") or ()) if isinstance(error, dict) else 0, -per_branch[branch(error)]),
    )
