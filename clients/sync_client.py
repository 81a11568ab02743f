"""Blocking client for streaming-input sessions, over REST (JSON/SSE) or a websocket.

with SessionsClient() as client:
    with client.sessions.create(defaults={"temperature": 0}) as session:
        reply = session.send("The meeting started at nine.")
        for delta in session.stream(" Then lunch."):
            print(delta.text, end="")
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
from websockets.exceptions import WebSocketException
from websockets.sync.client import ClientConnection, connect

from clients._common import (
    ChunkAssembler,
    ChunkInput,
    ChunkReply,
    ClientConfig,
    Delta,
    SessionObject,
    TranscriptResponse,
    Transport,
    append_event,
    backoff_s,
    check_response,
    chunk_payload,
    connection_error,
    create_payload,
    error_code,
    error_from_response,
    reply_from_rest,
    should_retry,
    sse_payloads,
)
from clients.errors import (
    APIConnectionError,
    NotFoundError,
    StreamsessError,
    error_from_body,
)


class SessionsClient:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = None,
        max_retries: int | None = None,
    ):
        self.config = ClientConfig.resolve(base_url, api_key, timeout, max_retries)
        self._http = httpx.Client(
            base_url=self.config.base_url, headers=self.config.headers, timeout=self.config.timeout
        )
        self.sessions = Sessions(self)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, json=body)
            except httpx.TransportError as exc:
                if attempt < self.config.max_retries and should_retry(method, exc, None):
                    time.sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise connection_error(exc) from exc
            code = error_code(response) if response.status_code == 503 else None
            if attempt < self.config.max_retries and should_retry(method, None, response.status_code, code):
                time.sleep(backoff_s(attempt))
                attempt += 1
                continue
            return check_response(response)

    def stream_sse(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        try:
            with self._http.stream("POST", path, json=body) as response:
                if not response.is_success:
                    response.read()
                    raise error_from_response(response)
                yield from sse_payloads(response.iter_lines())
        except httpx.TransportError as exc:
            raise connection_error(exc) from exc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SessionsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sessions:
    def __init__(self, client: SessionsClient):
        self._client = client

    def create(
        self,
        *,
        defaults: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        transport: Transport = "rest",
    ) -> Session:
        """Open a session; use it as ``with`` to close it on exit."""
        info = SessionObject.model_validate(
            self._client.request("POST", "/v1/sessions", create_payload(defaults, metadata))
        )
        return Session(self._client, info, transport)

    def attach(self, session_id: str, *, transport: Transport = "rest") -> Session:
        return Session(self._client, self.retrieve(session_id), transport)

    def list(self) -> list[SessionObject]:
        return [SessionObject.model_validate(item) for item in self._client.request("GET", "/v1/sessions")["data"]]

    def retrieve(self, session_id: str) -> SessionObject:
        return SessionObject.model_validate(self._client.request("GET", f"/v1/sessions/{session_id}"))

    def transcript(self, session_id: str) -> TranscriptResponse:
        return TranscriptResponse.model_validate(self._client.request("GET", f"/v1/sessions/{session_id}/transcript"))

    def delete(self, session_id: str) -> None:
        self._client.request("DELETE", f"/v1/sessions/{session_id}")


class Session:
    """One open session. REST or websocket, the same methods."""

    def __init__(self, client: SessionsClient, info: SessionObject, transport: Transport):
        self._client = client
        self.info = info
        self.id = info.id
        self.last_reply: ChunkReply | None = None
        self._ws: ClientConnection | None = None
        self._closed = False
        if transport == "websocket":
            self._connect_websocket()

    @property
    def transport(self) -> Transport:
        return "websocket" if self._ws is not None else "rest"

    def _connect_websocket(self) -> None:
        config = self._client.config
        try:
            # Entered by hand: the connection outlives this call and closes in close().
            self._ws = connect(
                config.ws_url(f"/v1/sessions/{self.id}/ws"),
                additional_headers=config.headers,
                open_timeout=config.timeout,
                max_size=None,
            ).__enter__()
            hello = json.loads(self._ws.recv(timeout=config.timeout))
        except (OSError, WebSocketException, TimeoutError) as exc:
            raise APIConnectionError(f"websocket connection failed: {exc}") from exc
        if hello.get("type") == "error":
            raise error_from_body(hello)

    def send(self, chunk: ChunkInput, **options: Any) -> ChunkReply:
        """Append a chunk and return the whole answer."""
        if self._ws is None:
            body = self._client.request("POST", f"/v1/sessions/{self.id}/chunks", chunk_payload(chunk, options))
            self.last_reply = reply_from_rest(body)
            return self.last_reply
        for _ in self.stream(chunk, **options):
            pass
        assert self.last_reply is not None
        return self.last_reply

    def stream(self, chunk: ChunkInput, **options: Any) -> Iterator[Delta]:
        """Append a chunk and yield its answer as it is generated; ``last_reply``
        holds the whole answer with usage once the stream ends."""
        assembler = ChunkAssembler(self.id)
        if self._ws is None:
            payload = {**chunk_payload(chunk, options), "stream": True}
            for event in self._client.stream_sse(f"/v1/sessions/{self.id}/chunks", payload):
                if (delta := assembler.feed_sse(event)) is not None:
                    yield delta
        else:
            ws = self._ws
            try:
                ws.send(append_event(chunk, options))
                while assembler.reply is None:
                    event = json.loads(ws.recv(timeout=self._client.config.timeout))
                    if (delta := assembler.feed_ws(event)) is not None:
                        yield delta
            except (WebSocketException, TimeoutError) as exc:
                raise APIConnectionError(f"websocket failed: {exc}") from exc
        if assembler.reply is None:
            raise StreamsessError("the stream ended without a final answer")
        self.last_reply = assembler.reply

    def transcript(self) -> TranscriptResponse:
        return self._client.sessions.transcript(self.id)

    def refresh(self) -> SessionObject:
        self.info = self._client.sessions.retrieve(self.id)
        return self.info

    def close(self) -> None:
        """Close the session on the server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._ws is not None:
            try:
                self._ws.send(json.dumps({"type": "session.close"}))
                # Wait for the server's word, so the close is done when we return.
                with contextlib.suppress(TimeoutError):
                    while (
                        json.loads(self._ws.recv(timeout=self._client.config.timeout)).get("type") != "session.closed"
                    ):
                        pass
                self._ws.close()
                return
            except WebSocketException:
                pass  # the socket is gone: close over REST instead
        with contextlib.suppress(NotFoundError):  # already closed or expired
            self._client.sessions.delete(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
