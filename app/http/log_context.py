"""JSON logs (``log_format=json``): each record one JSON object on stderr, with the
request id, the conversation it concerns (a session, conversation or response id) and
the replica, through python-json-logger (the formatter vLLM's own JSON logs use). The
API process's loggers (ours, uvicorn's, vLLM's) and, through ``VLLM_LOGGING_CONFIG_PATH``,
the engine's processes log so; the engine's records carry the replica but no request.

A request's id is its ``X-Request-Id`` header, or a new one (sent back in the response's
``X-Request-Id``); ids live in context variables set by ``RequestContextMiddleware``, so
the tasks a request starts (a chunk's) log with them too."""

from __future__ import annotations

import json
import logging
import logging.config
import os
import re
import uuid
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID: ContextVar[str | None] = ContextVar("streamsess_request_id", default=None)
CONVERSATION_ID: ContextVar[str | None] = ContextVar("streamsess_conversation_id", default=None)
REPLICA_ENV = "STREAMSESS_REPLICA_NAME"
# A conversation named in the path (/v1/sessions/{id}/..., /v1/conversations/{id}, /v1/responses/{id})
# or the query string (a websocket's session_id, a chain's previous_response_id).
PATH_ID = re.compile(r"^/v1/(?:sessions|conversations|responses)/([A-Za-z0-9_-]+)")
QUERY_ID = re.compile(r"(?:^|&)(?:session_id|previous_response_id|conversation)=([A-Za-z0-9_-]+)")
FIELDS = ("asctime", "levelname", "name", "message", "request_id", "session_id", "replica")


class ContextFilter(logging.Filter):
    """Adds ``request_id``, ``session_id`` and ``replica`` to every record."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.replica = os.environ.get(REPLICA_ENV) or None

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.session_id = CONVERSATION_ID.get()
        record.replica = self.replica
        return True


def logging_config(level: str) -> dict[str, Any]:
    """``logging.config.dictConfig``'s form, for this process and vLLM's (JSON-safe)."""
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "json",
        "filters": ["context"],
        "stream": "ext://sys.stderr",
        "level": level.upper(),
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": f"{__name__}.ContextFilter"}},
        "formatters": {
            "json": {
                "()": "pythonjsonlogger.json.JsonFormatter",
                "fmt": " ".join(f"%({field})s" for field in FIELDS),
                "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
            }
        },
        "handlers": {"json": handler},
        "root": {"handlers": ["json"], "level": level.upper()},
        # vLLM's logger does not propagate (vllm.logger): it gets the handler itself.
        "loggers": {
            name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
            for name in ("vllm", "uvicorn", "uvicorn.access", "uvicorn.error")
        },
    }


def configure(log_format: str, level: str, state_dir: str, replica: str | None) -> None:
    """Text: Python's default (vLLM keeps its own). JSON: this process's loggers now, and
    the engine's processes (started later, from this environment) by vLLM's config file."""
    if log_format != "json":
        logging.basicConfig(level=level.upper())
        return
    if replica:
        os.environ.setdefault(REPLICA_ENV, replica)
    config = logging_config(level)
    path = Path(state_dir) / "vllm-logging.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    logging.config.dictConfig(config)


class RequestContextMiddleware:
    """Sets the request's id and the conversation it names for the records it logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        named = PATH_ID.match(scope.get("path", "")) or QUERY_ID.search(
            scope.get("query_string", b"").decode("latin-1")
        )
        request_token = REQUEST_ID.set(request_id)
        conversation_token = CONVERSATION_ID.set(named.group(1) if named else None)
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(request_token)
            CONVERSATION_ID.reset(conversation_token)
