"""Add the device / CPU-tier / computed split to the usage of vLLM's OpenAI endpoints.

vLLM's ``/v1/completions`` and ``/v1/chat/completions`` report
``usage.prompt_tokens_details.cached_tokens`` only. This ASGI middleware gives
each such request an ``X-Request-Id`` (vLLM derives its engine request ids from
it), and adds ``device_tokens``, ``cpu_tier_tokens``, ``disk_tier_tokens`` and ``computed_tokens`` to
every usage object in the response, JSON or SSE, from the provenance recorder.
The endpoints themselves stay vLLM's, unchanged. An error vLLM sends inside a stream
(after its 200) takes OpenAI's shape here, as its errors before a stream do
(``app.http.errors``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.http.errors import openai_error
from app.provenance import ProvenanceRecorder

# Path -> prefix of the engine request ids vLLM derives from X-Request-Id.
_ENGINE_ID_PREFIX = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-"}


async def add_sources(usage: dict[str, Any], recorder: ProvenanceRecorder, id_prefix: str) -> None:
    sources = await recorder.pop_prefix(id_prefix)
    details = usage.get("prompt_tokens_details") or {}
    device = sources.device_tokens if sources else int(details.get("cached_tokens") or 0)
    tier = sources.cpu_tier_tokens if sources else 0
    disk = sources.disk_tier_tokens if sources else 0
    details.update(
        cached_tokens=device + tier + disk,
        device_tokens=device,
        cpu_tier_tokens=tier,
        disk_tier_tokens=disk,
        computed_tokens=max(int(usage.get("prompt_tokens") or 0) - device - tier - disk, 0),
    )
    usage["prompt_tokens_details"] = details


class UsageProvenanceMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        prefix = _ENGINE_ID_PREFIX.get(scope.get("path", "")) if scope["type"] == "http" else None
        if prefix is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", ()))
        request_id = next((v.decode() for k, v in headers if k == b"x-request-id"), None)
        if request_id is None:
            request_id = uuid.uuid4().hex
            headers.append((b"x-request-id", request_id.encode()))
            scope = {**scope, "headers": headers}
        # Starlette puts the app in the scope; its state holds the recorder once
        # the lifespan has started the engine.
        recorder = getattr(scope["app"].state, "provenance", None)
        rewriter = _UsageRewriter(send, recorder, prefix + request_id)
        await self.app(scope, receive, rewriter.send)


class _UsageRewriter:
    """Buffers a JSON body whole, or SSE events one at a time, and patches usage (and
    an error event's shape)."""

    def __init__(self, send: Send, recorder: ProvenanceRecorder | None, id_prefix: str):
        self._send = send
        self._recorder = recorder
        self._id_prefix = id_prefix
        self._start: Message | None = None
        self._mode = "passthrough"
        self._buffer = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            if message.get("status") == 200 and content_type.startswith(b"application/json"):
                self._mode, self._start = "json", message
                return
            if content_type.startswith(b"text/event-stream"):
                self._mode = "sse"
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._mode == "passthrough":
            await self._send(message)
            return
        self._buffer += message.get("body", b"")
        more = message.get("more_body", False)
        if self._mode == "json":
            if more:
                return
            body = await self._patch_json(self._buffer)
            assert self._start is not None
            headers = [(k, v) for k, v in self._start.get("headers", ()) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await self._send({**self._start, "headers": headers})
            await self._send({"type": "http.response.body", "body": body})
            return
        # SSE: forward every complete event, patched; keep a partial one buffered.
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = b"".join([await self._patch_sse(event) + b"\n\n" for event in events])
        if not more and self._buffer:
            out, self._buffer = out + self._buffer, b""
        await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _patch(self, payload: dict[str, Any]) -> bool:
        if (error := openai_error(payload.get("error"))) is not None:
            payload["error"] = error.body()["error"]
            return True
        usage = payload.get("usage")
        if not isinstance(usage, dict) or self._recorder is None:
            return False
        await add_sources(usage, self._recorder, self._id_prefix)
        return True

    async def _patch_json(self, body: bytes) -> bytes:
        try:
            payload = json.loads(body)
        except ValueError:
            return body
        return json.dumps(payload).encode() if isinstance(payload, dict) and await self._patch(payload) else body

    async def _patch_sse(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            payload = json.loads(event[len(b"data: ") :])
        except ValueError:
            return event
        return b"data: " + json.dumps(payload).encode() if await self._patch(payload) else event
