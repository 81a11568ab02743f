"""Async client for streaming-input sessions, over REST (JSON/SSE) or a websocket.

async with AsyncSessionsClient() as client:
    async with client.sessions.create(defaults={"temperature": 0}) as session:
        reply = await session.send("The meeting started at nine.")
        async for delta in session.stream(" Then lunch."):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Generator
from types import TracebackType
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

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
)
from clients.errors import (
    APIConnectionError,
    NotFoundError,
    StreamsessError,
    error_from_body,
)


class AsyncSessionsClient:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | None = None,
        max_retries: int | None = None,
    ):
        self.config = ClientConfig.resolve(base_url, api_key, timeout, max_retries)
        self._http = httpx.AsyncClient(
            base_url=self.config.base_url, headers=self.config.headers, timeout=self.config.timeout
        )
        self.sessions = AsyncSessions(self)

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.TransportError as exc:
                if attempt < self.config.max_retries and should_retry(method, exc, None):
                    await asyncio.sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise connection_error(exc) from exc
            code = error_code(response) if response.status_code == 503 else None
            if attempt < self.config.max_retries and should_retry(method, None, response.status_code, code):
                await asyncio.sleep(backoff_s(attempt))
                attempt += 1
                continue
            return check_response(response)

    async def stream_sse(self, path: str, body: Any) -> AsyncIterator[dict[str, Any]]:
        try:
            async with self._http.stream("POST", path, json=body) as response:
                if not response.is_success:
                    await response.aread()
                    raise error_from_response(response)
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        if data == "[DONE]":
                            return
                        yield json.loads(data)
        except httpx.TransportError as exc:
            raise connection_error(exc) from exc

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSessionsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSessions:
    def __init__(self, client: AsyncSessionsClient):
        self._client = client

    def create(
        self,
        *,
        defaults: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        transport: Transport = "rest",
    ) -> _SessionOpener:
        """Open a session: ``await`` it, or use it as ``async with`` to close it on exit."""
        return _SessionOpener(self._open(create_payload(defaults, metadata), None, transport))

    def attach(self, session_id: str, *, transport: Transport = "rest") -> _SessionOpener:
        """Use an existing session (``async with`` closes it on exit, as ``create`` does)."""
        return _SessionOpener(self._open(None, session_id, transport))

    async def _open(self, payload: dict[str, Any] | None, session_id: str | None, transport: Transport) -> AsyncSession:
        if session_id is None:
            info = SessionObject.model_validate(await self._client.request("POST", "/v1/sessions", payload))
        else:
            info = await self.retrieve(session_id)
        session = AsyncSession(self._client, info)
        if transport == "websocket":
            await session._connect_websocket()
        return session

    async def list(self) -> list[SessionObject]:
        body = await self._client.request("GET", "/v1/sessions")
        return [SessionObject.model_validate(item) for item in body["data"]]

    async def retrieve(self, session_id: str) -> SessionObject:
        return SessionObject.model_validate(await self._client.request("GET", f"/v1/sessions/{session_id}"))

    async def transcript(self, session_id: str) -> TranscriptResponse:
        body = await self._client.request("GET", f"/v1/sessions/{session_id}/transcript")
        return TranscriptResponse.model_validate(body)

    async def delete(self, session_id: str) -> None:
        await self._client.request("DELETE", f"/v1/sessions/{session_id}")


class _SessionOpener:
    """Awaitable, and an async context manager that closes the session on exit."""

    def __init__(self, opening: Any):
        self._opening = opening
        self._session: AsyncSession | None = None

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._opening.__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._opening
        return self._session

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()


class AsyncSession:
    """One open session. REST or websocket, the same methods."""

    def __init__(self, client: AsyncSessionsClient, info: SessionObject):
        self._client = client
        self.info = info
        self.id = info.id
        self.last_reply: ChunkReply | None = None
        self._ws: ClientConnection | None = None
        self._closed = False

    @property
    def transport(self) -> Transport:
        return "websocket" if self._ws is not None else "rest"

    async def _connect_websocket(self) -> None:
        config = self._client.config
        try:
            self._ws = await connect(
                config.ws_url(f"/v1/sessions/{self.id}/ws"),
                additional_headers=config.headers,
                open_timeout=config.timeout,
                max_size=None,
            )
            hello = json.loads(await self._ws.recv())
        except (OSError, WebSocketException, TimeoutError) as exc:
            raise APIConnectionError(f"websocket connection failed: {exc}") from exc
        if hello.get("type") == "error":
            raise error_from_body(hello)

    async def send(self, chunk: ChunkInput, **options: Any) -> ChunkReply:
        """Append a chunk and return the whole answer."""
        if self._ws is None:
            body = await self._client.request("POST", f"/v1/sessions/{self.id}/chunks", chunk_payload(chunk, options))
            self.last_reply = reply_from_rest(body)
            return self.last_reply
        async for _ in self.stream(chunk, **options):
            pass
        assert self.last_reply is not None
        return self.last_reply

    async def stream(self, chunk: ChunkInput, **options: Any) -> AsyncIterator[Delta]:
        """Append a chunk and yield its answer as it is generated; ``last_reply``
        holds the whole answer with usage once the stream ends."""
        assembler = ChunkAssembler(self.id)
        if self._ws is None:
            payload = {**chunk_payload(chunk, options), "stream": True}
            async for event in self._client.stream_sse(f"/v1/sessions/{self.id}/chunks", payload):
                if (delta := assembler.feed_sse(event)) is not None:
                    yield delta
        else:
            ws = self._ws
            try:
                await ws.send(append_event(chunk, options))
                while assembler.reply is None:
                    event = json.loads(await asyncio.wait_for(ws.recv(), self._client.config.timeout))
                    if (delta := assembler.feed_ws(event)) is not None:
                        yield delta
            except (WebSocketException, TimeoutError) as exc:
                raise APIConnectionError(f"websocket failed: {exc}") from exc
        if assembler.reply is None:
            raise StreamsessError("the stream ended without a final answer")
        self.last_reply = assembler.reply

    async def transcript(self) -> TranscriptResponse:
        return await self._client.sessions.transcript(self.id)

    async def refresh(self) -> SessionObject:
        self.info = await self._client.sessions.retrieve(self.id)
        return self.info

    async def close(self) -> None:
        """Close the session on the server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._ws is not None:
            try:
                await self._ws.send(json.dumps({"type": "session.close"}))
                # Wait for the server's word, so the close is done when we return.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._client.config.timeout):
                        while json.loads(await self._ws.recv()).get("type") != "session.closed":
                            pass
                await self._ws.close()
                return
            except WebSocketException:
                pass  # the socket is gone: close over REST instead
        with contextlib.suppress(NotFoundError):  # already closed or expired
            await self._client.sessions.delete(self.id)
