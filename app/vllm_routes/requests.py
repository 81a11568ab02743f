"""The strict validation, cache salt and token count of vLLM's OpenAI requests, read
from each body once, before vLLM reads it."""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.entrypoints.generate.base.protocol import validate_cache_salt
from vllm.exceptions import VLLMValidationError

from app.cache_salt import CacheSalter
from app.errors import APIError
from app.http.auth import owner_of
from app.http.body import read_body, replaying
from app.http.errors import openai_error_bytes, reshaping_errors, send_http_error, validation_error
from app.limits import KeyLimits, estimated_tokens
from app.vllm_routes.routes import STATEFUL_FIELDS, OpenAIBodyRoute, strict_errors
from app.vllm_routes.sampling import check_sampling


class OpenAIRequestMiddleware:
    """Read the body of each of vLLM's POST routes in ``routes`` once, before vLLM does:

    - validate it in pydantic's strict mode where the route says so (no ``"1"`` for
      ``1``, as OpenAI's API answers), so the published schema is what the server
      enforces: 400 in the OpenAI shape otherwise;
    - on routes that generate, give it the caller's cache salt, in place of (and
      derived from) any the client sent (``salter``), and charge its estimated tokens
      to the caller's key (``limits``).

    A validator of vLLM's own that refuses the body (``VLLMValidationError``) gets the
    same 400, before any salting could mend the body; an error vLLM's handler answers
    takes OpenAI's shape too (``openai_error_bytes``). Bodies that are not a JSON object
    pass through untouched, for vLLM to refuse, as do bodies whose validation raises
    anything else (vLLM raises it again and answers it itself)."""

    def __init__(
        self,
        app: ASGIApp,
        routes: Mapping[str, OpenAIBodyRoute],
        salter: CacheSalter | None,
        limits: KeyLimits | None,
        default_max_tokens: int,
    ):
        self.app = app
        self.routes = routes
        self.salter = salter
        self.limits = limits
        self.default_max_tokens = default_max_tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self.routes.get(scope.get("path", "")) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # bounded by BodySizeLimitMiddleware, outside
        if body is None:
            return
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # not JSON (nor UTF-8), or nested too deep: vLLM refuses it
            payload = None
        if isinstance(payload, dict):
            if not route.stateful and (field := next((f for f in STATEFUL_FIELDS if f in payload), None)):
                await send_http_error(
                    send,
                    APIError(
                        400,
                        f"{field} is honoured on /v1/responses only; this route keeps no state.",
                        code="unsupported_parameter",
                        param=field,
                    ),
                )
                return
            if route.strict_validator is not None:
                try:
                    # vLLM's rule for salts, which some of its routes (chat batches) skip.
                    validate_cache_salt(payload.get("cache_salt"))
                    service = getattr(scope["app"].state, "session_service", None) if "app" in scope else None
                    check_sampling(payload, getattr(service, "max_model_len", None))
                    if errors := strict_errors(route.strict_validator, body, payload):
                        # Located in the body, as FastAPI's own are (a field named
                        # "query" is not the query string).
                        located = [{**error, "loc": ("body", *error.get("loc", ()))} for error in errors]
                        await send_http_error(send, validation_error(RequestValidationError(located)))
                        return
                except VLLMValidationError as invalid:  # raised by one of vLLM's own validators
                    reason = str(invalid.args[0]) if invalid.args else "Invalid request."
                    error = APIError(400, reason, code="invalid_request", param=invalid.parameter)
                    await send_http_error(send, error)
                    return
                except (AttributeError, TypeError, KeyError, IndexError) as crash:
                    # One of vLLM's before-validators read a field of the wrong shape
                    # (``structured_outputs: []``): FastAPI's own validation would hit
                    # the same and answer 500. The body is what is wrong.
                    await send_http_error(send, APIError(400, f"Invalid request body: {crash}", code="invalid_request"))
                    return
                except Exception:  # any other: vLLM raises it again and answers it its own way
                    pass
            owner = owner_of(scope)
            if route.generates and self.limits is not None:
                try:
                    await self.limits.charge_tokens(owner, estimated_tokens(payload, self.default_max_tokens))
                except APIError as error:
                    await send_http_error(send, error)
                    return
            if route.generates and self.salter is not None:
                client_salt = payload.get("cache_salt")
                payload["cache_salt"] = self.salter.salt(owner, client_salt if isinstance(client_salt, str) else None)
                body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app(
            {**scope, "headers": headers}, replaying(body, receive), reshaping_errors(send, openai_error_bytes)
        )
