"""Server errors as exceptions that carry the OpenAI error fields."""

from __future__ import annotations

from typing import Any


class StreamsessError(Exception):
    """Base class of every error this client raises."""


class APIConnectionError(StreamsessError):
    """The server could not be reached, or the connection broke."""


class APITimeoutError(APIConnectionError):
    """The server did not answer in time."""


class APIStatusError(StreamsessError):
    """The server answered with an error: ``{"error": {"message", "type", "param", "code"}}``."""

    status_code: int | None = None

    def __init__(
        self,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        status_code: int | None = None,
        body: Any = None,
    ):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        if status_code is not None:
            self.status_code = status_code
        self.body = body

    def __str__(self) -> str:
        where = f" (param {self.param})" if self.param else ""
        return f"[{self.status_code or '-'} {self.code}] {self.message}{where}"


class BadRequestError(APIStatusError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class PermissionDeniedError(APIStatusError):
    status_code = 403


class NotFoundError(APIStatusError):
    status_code = 404


class ConflictError(APIStatusError):
    status_code = 409


class RequestTooLargeError(APIStatusError):
    status_code = 413


class RateLimitError(APIStatusError):
    status_code = 429


class InternalServerError(APIStatusError):
    status_code = 500


_BY_STATUS: dict[int, type[APIStatusError]] = {
    cls.status_code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        ConflictError,
        RequestTooLargeError,
        RateLimitError,
        InternalServerError,
    )
}
# Websocket errors carry no HTTP status; their OpenAI type names the class.
_BY_TYPE: dict[str, type[APIStatusError]] = {
    "invalid_request_error": BadRequestError,
    "authentication_error": AuthenticationError,
    "permission_error": PermissionDeniedError,
    "not_found_error": NotFoundError,
    "conflict_error": ConflictError,
    "rate_limit_error": RateLimitError,
    "server_error": InternalServerError,
}


def error_from_body(body: Any, status_code: int | None = None) -> APIStatusError:
    """Build the typed exception for an error body (REST) or error event (websocket)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        error = {"message": str(body) or "unknown error"}
    cls = None
    if status_code is not None:
        cls = _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else None)
    if cls is None:
        cls = _BY_TYPE.get(str(error.get("type")), APIStatusError)
    return cls(
        str(error.get("message") or "unknown error"),
        type=error.get("type"),
        code=error.get("code"),
        param=error.get("param"),
        status_code=status_code,
        body=body,
    )
