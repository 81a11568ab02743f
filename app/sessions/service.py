"""SessionService: create, append, stream, close and expire sessions. No FastAPI here.

Every limit lives here, so REST and websocket enforce the same ones, and every
refusal is an ``APIError`` in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from app.errors import APIError, session_not_found
from app.metrics import SessionMetrics
from app.provenance import ProvenanceRecorder
from app.sessions.protocol import (
    SAMPLING_FIELDS,
    SamplingOptions,
    SessionCreateRequest,
    SessionDefaults,
    SessionObject,
)
from app.sessions.session import (
    ENGINE_ERROR,
    ChunkDelta,
    ChunkResult,
    SessionFailedError,
    StreamingSession,
)
from app.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
# Closed sessions are remembered this many at a time, so a late append gets
# "closed (expired)" rather than "unknown".
CLOSED_SESSIONS_KEPT = 1024


@dataclass
class PreparedChunk:
    """A validated chunk that holds its session's lock until it has streamed."""

    session: StreamingSession
    input_ids: list[int]
    params: SamplingParams
    transport: str


class SessionService:
    def __init__(
        self,
        engine: Any,
        settings: Settings,
        model_name: str,
        tokenizer: Any,
        metrics: SessionMetrics,
        recorder: ProvenanceRecorder | None = None,
    ):
        self._engine = engine
        self._settings = settings
        self.model_name = model_name
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._recorder = recorder
        self._vocab_size = engine.model_config.get_vocab_size()
        self._max_context = min(settings.max_model_len, engine.model_config.max_model_len)
        self._sessions: dict[str, StreamingSession] = {}
        self._closed: OrderedDict[str, StreamingSession] = OrderedDict()
        self._reaper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle(), name="session-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await asyncio.gather(
            *(self._close(s, "server_shutdown") for s in list(self._sessions.values())),
            return_exceptions=True,
        )

    async def _reap_idle(self) -> None:
        timeout = self._settings.session_idle_timeout_s
        interval = min(5.0, max(timeout / 4, 0.05))
        while True:
            await asyncio.sleep(interval)
            now = time.time()
            for session in list(self._sessions.values()):
                if session.status == "active" and not session.lock.locked() and now - session.last_activity > timeout:
                    logger.info("session %s idle for %.0fs: closing", session.id, now - session.last_activity)
                    await self._close(session, "expired")

    # ------------------------------------------------------------------ lookup
    def create(self, owner: str, request: SessionCreateRequest, session_id: str | None = None) -> StreamingSession:
        """Open a session. ``session_id`` lets the client choose the id (the
        ``X-Session-ID`` header), so a proxy can route creation and every later
        request of the session to the same replica by hashing it."""
        if session_id is not None:
            self._check_session_id(session_id)
        if request.model is not None and request.model != self.model_name:
            raise APIError(404, f"The model {request.model!r} does not exist.", code="model_not_found", param="model")
        if len(self._sessions) >= self._settings.max_sessions:
            self._metrics.chunk_errors.labels("too_many_sessions").inc()
            raise APIError(
                429,
                f"The server holds its maximum of {self._settings.max_sessions} open sessions; "
                "close one or retry later.",
                code="too_many_sessions",
            )
        self._check_sampling(request.defaults, "defaults")
        session = StreamingSession(
            session_id=session_id or f"sess_{secrets.token_hex(12)}",
            owner=owner,
            model=self.model_name,
            engine=self._engine,
            defaults=request.defaults,
            metadata=dict(request.metadata),
            max_tokens=self._max_context,
            recorder=self._recorder,
        )
        self._sessions[session.id] = session
        self._metrics.sessions_total.inc()
        self._metrics.sessions_open.set(len(self._sessions))
        return session

    def get(self, owner: str, session_id: str, *, include_closed: bool = False) -> StreamingSession:
        session = self._sessions.get(session_id)
        if session is None and include_closed:
            session = self._closed.get(session_id)
        # Another key's session is "not found": its existence is not ours to reveal.
        if session is None or session.owner != owner:
            raise session_not_found(session_id)
        return session

    def owned_by(self, owner: str) -> list[StreamingSession]:
        return [s for s in self._sessions.values() if s.owner == owner]

    def describe(self, session: StreamingSession) -> SessionObject:
        timeout = self._settings.session_idle_timeout_s
        return SessionObject(
            id=session.id,
            model=session.model,
            created=session.created,
            status=session.status,
            close_reason=session.close_reason,
            defaults=session.defaults,
            metadata=session.metadata,
            num_chunks=session.num_chunks,
            num_tokens=len(session.token_ids),
            max_tokens=session.max_tokens,
            last_activity_at=session.last_activity,
            expires_at=None if session.closed else session.last_activity + timeout,
        )

    def update_defaults(self, owner: str, session_id: str, defaults: SessionDefaults) -> StreamingSession:
        session = self._open_session(owner, session_id)
        self._check_sampling(defaults, "session")
        merged = session.defaults.model_dump(exclude_none=True) | defaults.model_dump(exclude_none=True)
        session.defaults = SessionDefaults(**merged)
        session.last_activity = time.time()
        return session

    def transcript(self, owner: str, session_id: str) -> tuple[StreamingSession, str]:
        session = self.get(owner, session_id, include_closed=True)
        return session, self._tokenizer.decode(session.token_ids)

    # ------------------------------------------------------------------ chunks
    async def prepare_chunk(
        self,
        owner: str,
        session_id: str,
        chunk_input: str | list[int],
        options: SamplingOptions,
        *,
        transport: str,
        wait: bool,
    ) -> PreparedChunk:
        """Validate a chunk and take the session's lock.

        ``wait=False`` (REST) refuses a second chunk in flight with 409;
        ``wait=True`` (websocket) queues behind it, in order.
        """
        session = self._open_session(owner, session_id)
        input_ids = self._encode(chunk_input)
        params = self._sampling_params(session, options)
        self._check_chunk(session, input_ids, params)
        if not wait and session.lock.locked():
            self._metrics.chunk_errors.labels("chunk_in_flight").inc()
            raise APIError(
                409,
                "This session is already answering a chunk; send the next one when it is done.",
                code="chunk_in_flight",
            )
        await session.lock.acquire()
        try:
            # Re-check after waiting: the session may have closed or grown meanwhile.
            if session.closed:
                raise self._closed_error(session)
            self._check_chunk(session, input_ids, params)
        except BaseException:
            session.lock.release()
            raise
        return PreparedChunk(session, input_ids, params, transport)

    async def stream_chunk(self, prepared: PreparedChunk) -> AsyncGenerator[ChunkDelta | ChunkResult, None]:
        """Run a prepared chunk and release its session's lock at the end."""
        session = prepared.session
        try:
            async for event in session.generate(prepared.input_ids, prepared.params):
                if isinstance(event, ChunkResult):
                    self._observe(event, prepared.transport)
                yield event
        except SessionFailedError as exc:
            if session.close_reason == ENGINE_ERROR:
                self._metrics.chunk_errors.labels("session_failed").inc()
                await self._close(session, ENGINE_ERROR)
                raise APIError(500, f"The session failed and was closed: {exc}", code="session_failed") from exc
            # Closed by someone else (DELETE, shutdown) while answering.
            self._metrics.chunk_errors.labels("session_closed").inc()
            raise APIError(
                409, f"The session was closed ({session.close_reason}) while answering this chunk.",
                code="session_closed",
            ) from exc
        finally:
            session.lock.release()
            if session.closed:
                self._forget(session)

    async def run_chunk(self, prepared: PreparedChunk) -> ChunkResult:
        """Run a prepared chunk to its end."""
        result: ChunkResult | None = None
        async with contextlib.aclosing(self.stream_chunk(prepared)) as events:
            async for event in events:
                if isinstance(event, ChunkResult):
                    result = event
        assert result is not None
        return result

    def _observe(self, result: ChunkResult, transport: str) -> None:
        metrics = self._metrics
        metrics.chunks_total.labels(transport).inc()
        if result.time_to_first_token is not None:
            metrics.chunk_ttft.observe(result.time_to_first_token)
        details = result.usage.prompt_tokens_details
        metrics.prompt_tokens.labels("device").inc(details.device_tokens)
        metrics.prompt_tokens.labels("cpu_tier").inc(details.cpu_tier_tokens)
        metrics.prompt_tokens.labels("computed").inc(details.computed_tokens)

    # ------------------------------------------------------------------ closing
    async def close(self, owner: str, session_id: str, reason: str = "deleted") -> StreamingSession:
        session = self.get(owner, session_id)
        await self._close(session, reason)
        return session

    async def abort(self, session: StreamingSession, reason: str) -> None:
        """Abort at once, e.g. when a client vanished mid-chunk."""
        session.terminate(reason)
        await self._close(session, reason)

    async def _close(self, session: StreamingSession, reason: str) -> None:
        await session.close(reason)
        if not session.lock.locked():
            self._forget(session)

    def _forget(self, session: StreamingSession) -> None:
        if self._sessions.pop(session.id, None) is not None:
            self._metrics.sessions_closed.labels(session.close_reason or "closed").inc()
            self._metrics.sessions_open.set(len(self._sessions))
            self._closed[session.id] = session
            while len(self._closed) > CLOSED_SESSIONS_KEPT:
                self._closed.popitem(last=False)

    # ------------------------------------------------------------------ checks
    def _check_session_id(self, session_id: str) -> None:
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise APIError(
                400, "A session id is 1 to 128 letters, digits, '_', '-' or '.', starting with a letter or digit.",
                code="invalid_session_id", param="X-Session-ID",
            )
        if session_id in self._sessions or session_id in self._closed:
            raise APIError(409, f"A session with id {session_id!r} exists already.", code="session_exists",
                           param="X-Session-ID")

    def _open_session(self, owner: str, session_id: str) -> StreamingSession:
        session = self.get(owner, session_id, include_closed=True)
        if session.closed:
            raise self._closed_error(session)
        return session

    @staticmethod
    def _closed_error(session: StreamingSession) -> APIError:
        return APIError(
            409,
            f"Session {session.id} is closed ({session.close_reason}); open a new session.",
            code="session_closed",
            param="session_id",
        )

    def _encode(self, chunk_input: str | list[int]) -> list[int]:
        if isinstance(chunk_input, str):
            # No special tokens: chunks concatenate into one context.
            ids = list(self._tokenizer.encode(chunk_input, add_special_tokens=False))
            if not ids:
                raise APIError(400, "The chunk's text encodes to no tokens.", code="empty_input", param="input")
            return ids
        bad = next((t for t in chunk_input if t >= self._vocab_size), None)
        if bad is not None:
            raise APIError(
                400, f"Token id {bad} is outside the vocabulary (size {self._vocab_size}).",
                code="invalid_token_id", param="input",
            )
        return list(chunk_input)

    def _check_sampling(self, options: SamplingOptions, param: str) -> None:
        limit = self._settings.max_chunk_output_tokens
        if options.max_tokens is not None and options.max_tokens > limit:
            raise APIError(
                400, f"max_tokens may be at most {limit} per chunk.", code="max_tokens_too_large",
                param=f"{param}.max_tokens" if param != "chunk" else "max_tokens",
            )

    def _check_chunk(self, session: StreamingSession, input_ids: list[int], params: SamplingParams) -> None:
        limit = self._settings.max_chunk_tokens
        if len(input_ids) > limit:
            self._metrics.chunk_errors.labels("chunk_too_large").inc()
            raise APIError(
                400, f"The chunk has {len(input_ids)} tokens; the limit is {limit}.",
                code="chunk_too_large", param="input",
            )
        needed = len(session.token_ids) + len(input_ids) + (params.max_tokens or 0)
        if needed > session.max_tokens:
            self._metrics.chunk_errors.labels("context_length_exceeded").inc()
            raise APIError(
                400,
                f"The session holds {len(session.token_ids)} tokens; this chunk ({len(input_ids)} tokens) "
                f"plus max_tokens ({params.max_tokens}) would exceed the maximum context of "
                f"{session.max_tokens} tokens. Open a new session.",
                code="context_length_exceeded", param="input",
            )

    def _sampling_params(self, session: StreamingSession, options: SamplingOptions) -> SamplingParams:
        self._check_sampling(options, "chunk")
        chosen: dict[str, Any] = session.defaults.model_dump(exclude_none=True)
        chosen.update({k: v for k in SAMPLING_FIELDS if (v := getattr(options, k)) is not None})
        chosen.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        try:
            # Streaming input needs n == 1, no stop strings and a non-final output kind.
            return SamplingParams(output_kind=RequestOutputKind.DELTA, **chosen)
        except (ValueError, TypeError) as exc:
            raise APIError(400, f"Invalid sampling parameters: {exc}", code="invalid_sampling_params") from exc
