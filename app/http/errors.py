"""Errors over HTTP: FastAPI's handlers and raw ASGI refusals, in the OpenAI shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Message, Receive, Scope, Send

from app.errors import APIError, error_param, internal_error, most_specific


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers={**(error.headers or {}), **(headers or {})})


async def vllm_answer(call: Awaitable[Response], request: Request) -> Response:
    """A vLLM handler's answer to a request one of our routes handed it, in OpenAI's
    shape: what it returns, or what the app's handler for what it raises answers
    (vLLM registers one for its errors), reshaped (``openai_shaped``)."""
    try:
        response = await call
    except Exception as exc:
        handler = next(
            (request.app.exception_handlers[cls] for cls in type(exc).__mro__ if cls in request.app.exception_handlers),
            None,
        )
        if handler is None:
            raise
        response = await handler(request, exc)
    return openai_shaped(response)


def openai_shaped(response: Response) -> Response:
    """A response of one of vLLM's handlers, its error (if any) in OpenAI's shape."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    shaped = openai_error_body(response.status_code, bytes(response.body))
    return response if shaped is None else error_response(shaped)


def openai_error_body(status: int, body: bytes) -> APIError | None:
    """vLLM's handlers answer errors with their exception's name as the type and the
    status as the code (``"type": "BadRequestError", "code": 400``); the same error in
    OpenAI's shape, as this app's own are (None for any other body: ours, Anthropic's)."""
    return openai_error(error_object(body), status)


def error_object(body: bytes) -> Any:
    """The ``error`` of a JSON error body (None if it has none)."""
    try:
        return json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None


def openai_error(error: Any, status: int | None = None) -> APIError | None:
    """One of vLLM's error objects (in a body, or an event of a stream: ``status``
    then comes from its code) as this app's error; None for any other object."""
    if not isinstance(error, dict) or not isinstance(error.get("code"), int) or isinstance(error["code"], bool):
        return None
    status = status or error["code"]
    param = error.get("param") if isinstance(error.get("param"), str) else None
    if status == 404 and param == "model":
        code = "model_not_found"
    else:
        code = "invalid_request" if status == 400 else status_code(status)
    return APIError(status, str(error.get("message") or status_phrase(status)), code=code, param=param)


def openai_error_bytes(status: int, body: bytes) -> bytes | None:
    error = openai_error_body(status, body)
    return None if error is None else json.dumps(error.body()).encode()


# Anthropic's routes (vLLM's): Anthropic's SDK reads its own error shape,
# {"type": "error", "error": {"type", "message"}}, with these types.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_bytes(status: int, body: bytes) -> bytes | None:
    """Any JSON error (OpenAI's shape, or vLLM's Anthropic one with its exception's
    name as the type) in Anthropic's shape."""
    if not isinstance(error := error_object(body), dict):
        return None
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    message = str(error.get("message") or status_phrase(status))
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def reshaping_errors(send: Send, reshape: Callable[[int, bytes], bytes | None]) -> Send:
    """``send`` for a response whose error, answered as JSON, is held until its body is
    whole, then sent as ``reshape`` makes it (as it was, where that gives None);
    everything else passes as it comes."""
    held: list[Message] = []

    async def reshaping_send(message: Message) -> None:
        if (
            message["type"] == "http.response.start"
            and message["status"] >= 400
            and any(
                name == b"content-type" and value.startswith(b"application/json")
                for name, value in message.get("headers", ())
            )
        ):
            held.append(message)
            return
        if not held or message["type"] != "http.response.body":
            await send(message)
            return
        held.append(message)
        if message.get("more_body"):
            return
        start, parts = held[0], held[1:]
        body = b"".join(part.get("body", b"") for part in parts)
        body = reshape(start["status"], body) or body
        headers = [(k, v) for k, v in start.get("headers", ()) if k != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return reshaping_send


def status_phrase(status: int) -> str:
    return HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""


def status_code(status: int) -> str:
    """An error code named after the HTTP status (``method_not_allowed``)."""
    return status_phrase(status).lower().replace(" ", "_") or "error"


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = most_specific(errors) if errors else {}
    if not isinstance(first, dict):
        # vLLM's own routes raise it with plain strings.
        return APIError(400, str(first) or "Invalid request.", code="invalid_request")
    if first.get("type") == "json_invalid":
        return APIError(400, "The request body is not valid JSON.", code="invalid_json")
    message = first.get("msg", "Invalid request.")
    loc = first.get("loc", ())
    param = "X-Session-ID" if list(loc)[:2] == ["header", "x-session-id"] else error_param(loc)
    return APIError(400, f"{param}: {message}" if param else message, code="invalid_request", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Map every error our routes raise to the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug (ours or vLLM's): still the OpenAI shape, and no detail that could
        # carry request text; the traceback goes to the log (Starlette re-raises it).
        return error_response(internal_error())

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return error_response(APIError(400, "The request body is not valid JSON.", code="invalid_json"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = APIError(
            exc.status_code, str(exc.detail or status_phrase(exc.status_code)), code=status_code(exc.status_code)
        )
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(request))
        return error_response(error, headers=headers)


def declare_error_codes(schema: dict[str, Any]) -> None:
    """Make the OpenAPI schema state the errors as they are sent: vLLM's ``ErrorInfo``
    declares an integer code (its own handlers send the HTTP status), while every error
    leaves this app with OpenAI's string code (``openai_error_bytes``; on Anthropic's
    routes, in Anthropic's shape); and every operation may get the middlewares'
    refusals, which vLLM's routes do not declare, and its validation errors as 400, not
    FastAPI's 422."""
    components = schema.get("components", {}).get("schemas", {})
    info = components.get("ErrorInfo")
    if info is not None and "code" in info.get("properties", {}):
        info["properties"]["code"] = {
            "anyOf": [{"type": "string"}, {"type": "null"}],
            "title": "Code",
        }
    if "ErrorResponse" in components:
        _declare_middleware_errors(schema)


# What any route may answer besides its own responses: the middlewares' refusals
# (key, body size, rate limits, a dead engine) and, where a path names a resource,
# an unknown one (vLLM's /v1/responses/{response_id} answers 404).
MIDDLEWARE_ERRORS = {
    "401": "Missing or invalid API key",
    "413": "Request body too large",
    "429": "Rate limit of the API key reached (with Retry-After)",
    "503": "The engine is unavailable (with Retry-After)",
}


def _declare_middleware_errors(schema: dict[str, Any]) -> None:
    anthropic = "AnthropicErrorResponse" in schema["components"]["schemas"]
    for path, operations in schema.get("paths", {}).items():
        shape = "AnthropicErrorResponse" if anthropic and path in ANTHROPIC_PATHS else "ErrorResponse"
        error = {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}
        declared = dict(MIDDLEWARE_ERRORS)
        if "{" in path:
            declared["404"] = "No such resource"
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            # FastAPI declares its 422; this app answers validation errors 400, in the OpenAI shape.
            if responses.pop("422", None) is not None:
                responses.setdefault("400", {"description": "Invalid request", **error})
            for status, description in declared.items():
                responses.setdefault(status, {"description": description, **error})


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only
    the first route's, where several routes share a path)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches({**request.scope, "type": "http"})[0] != Match.NONE:
            methods |= set(route_methods)
    return sorted(methods)


async def send_http_error(send: Send, error: APIError, extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer an HTTP request from ASGI middleware with an OpenAI-shaped error."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


async def send_refusal(
    scope: Scope,
    receive: Receive,
    send: Send,
    error: APIError,
    *,
    ws_close_code: int,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Refuse a request from ASGI middleware: HTTP gets the error response; a
    websocket is accepted, told why in an error event, and closed with
    ``ws_close_code`` (browsers cannot read an HTTP refusal of a handshake)."""
    if scope["type"] == "http":
        await send_http_error(send, error, extra_headers)
        return
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    event = {"type": "error", "event_id": f"event_{error.code}", "error": {**error.body()["error"], "event_id": None}}
    await send({"type": "websocket.send", "text": json.dumps(event)})
    await send({"type": "websocket.close", "code": ws_close_code, "reason": error.code})
