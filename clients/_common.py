"""What the sync and async clients share: configuration, typed results, wire parsing,
and the retry policy. No I/O here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from app.api.sessions.protocol import TranscriptResponse
from app.protocol import ChunkUsage, SessionDefaults, SessionObject
from clients.errors import APIConnectionError, APIStatusError, APITimeoutError, error_from_body

Transport = Literal["rest", "websocket"]
# A chunk: text, token ids, or chat messages ({"role", "content"}), which the server
# renders with the model's chat template as the session's next turn.
ChunkInput = str | list[int] | list[dict[str, str]]

BASE_URL_ENV = "STREAMSESS_BASE_URL"
API_KEY_ENV = "STREAMSESS_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_MAX_RETRIES = 2

__all__ = [
    "ChunkReply",
    "ChunkUsage",
    "ClientConfig",
    "Delta",
    "SessionDefaults",
    "SessionObject",
    "TranscriptResponse",
]


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str | None
    timeout: float
    max_retries: int

    @classmethod
    def resolve(
        cls, base_url: str | None, api_key: str | None, timeout: float | None, max_retries: int | None
    ) -> ClientConfig:
        return cls(
            base_url=(base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/"),
            api_key=api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None,
            timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout,
            max_retries=DEFAULT_MAX_RETRIES if max_retries is None else max_retries,
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ws_url(self, path: str) -> str:
        base = self.base_url
        if base.startswith("https://"):
            return "wss://" + base[len("https://") :] + path
        return "ws://" + base.removeprefix("http://") + path


@dataclass(frozen=True)
class Delta:
    """A piece of a chunk's answer as it streams."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class ChunkReply:
    """A chunk's whole answer, with usage split by where the prompt's KV came from."""

    session_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: ChunkUsage

    @property
    def cached_tokens(self) -> int:
        return self.usage.prompt_tokens_details.cached_tokens

    @property
    def cpu_tier_tokens(self) -> int:
        return self.usage.prompt_tokens_details.cpu_tier_tokens


def chunk_payload(chunk: ChunkInput, options: dict[str, Any]) -> dict[str, Any]:
    return {"input": chunk, **{k: v for k, v in options.items() if v is not None}}


def create_payload(defaults: dict[str, Any] | None, metadata: dict[str, str] | None) -> dict[str, Any]:
    return {"defaults": defaults or {}, "metadata": metadata or {}}


def check_response(response: httpx.Response) -> Any:
    """The JSON body of a successful response, or the typed error."""
    if response.is_success:
        return response.json()
    raise error_from_response(response)


def error_from_response(response: httpx.Response) -> APIStatusError:
    try:
        body: Any = response.json()
    except ValueError:
        body = {"error": {"message": response.text or response.reason_phrase}}
    return error_from_body(body, response.status_code)


def connection_error(exc: Exception) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"timed out: {exc}")
    return APIConnectionError(f"connection failed: {exc}")


def reply_from_rest(body: dict[str, Any]) -> ChunkReply:
    return ChunkReply(
        session_id=body["session_id"],
        index=body["index"],
        text=body["output"]["text"],
        token_ids=list(body["output"]["token_ids"]),
        finish_reason=body["finish_reason"],
        usage=ChunkUsage.model_validate(body["usage"]),
    )


class ChunkAssembler:
    """Turns a chunk's stream (SSE payloads or websocket events) into deltas and a reply."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.reply: ChunkReply | None = None

    def _delta(self, delta: dict[str, Any]) -> Delta:
        piece = Delta(text=delta["text"], token_ids=list(delta["token_ids"]))
        self.text.append(piece.text)
        self.token_ids.extend(piece.token_ids)
        return piece

    def _finish(self, index: int, finish_reason: str | None, usage: dict[str, Any]) -> None:
        self.reply = ChunkReply(
            session_id=self.session_id,
            index=index,
            text="".join(self.text),
            token_ids=list(self.token_ids),
            finish_reason=finish_reason,
            usage=ChunkUsage.model_validate(usage),
        )

    def feed_sse(self, payload: dict[str, Any]) -> Delta | None:
        if "error" in payload:
            raise error_from_body(payload)
        if payload.get("object") == "session.chunk.delta":
            return self._delta(payload["delta"])
        if payload.get("object") == "session.chunk.done":
            self._finish(payload["index"], payload["finish_reason"], payload["usage"])
        return None

    def feed_ws(self, event: dict[str, Any]) -> Delta | None:
        kind = event.get("type")
        if kind == "error":
            raise error_from_body(event)
        if kind == "response.output.delta":
            return self._delta(event["delta"])
        if kind == "response.done":
            self._finish(event["chunk_index"], event["finish_reason"], event["usage"])
        return None


def sse_payloads(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


def append_event(chunk: ChunkInput, options: dict[str, Any]) -> str:
    return json.dumps({"type": "input.append", **chunk_payload(chunk, options)})


# -- retries -----------------------------------------------------------------------------
# A chunk append is never retried once sent: the server may already have applied it,
# unless the server says it did nothing (a draining replica's refusal, an undone chunk):
# then another replica takes the session up. Reads and deletes are idempotent; any
# request may be retried if it never left.

SAFE_METHODS = frozenset({"GET", "DELETE"})
RETRY_STATUSES = frozenset({502, 503, 504})
NOTHING_DONE_CODES = frozenset({"server_draining", "chunk_undone", "replica_unavailable", "store_unavailable"})


def error_code(response: httpx.Response) -> str | None:
    """The OpenAI error shape's code, if the response has one."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def should_retry(method: str, error: Exception | None, status: int | None, code: str | None = None) -> bool:
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return True
    if status == 503 and code in NOTHING_DONE_CODES:
        return True
    if method not in SAFE_METHODS:
        return False
    if error is not None:
        return isinstance(error, httpx.TransportError)
    return status in RETRY_STATUSES


def backoff_s(attempt: int) -> float:
    return min(0.25 * 2**attempt, 4.0)
