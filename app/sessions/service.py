"""SessionService: create, append, stream, park, close and expire sessions. No FastAPI here.

Every limit lives here, so REST and websocket enforce the same ones, and every
refusal is an ``APIError`` in the OpenAI shape.

Sessions are bounded by the CPU tier, not by device memory: an idle session is
*parked* (its engine request ended, its KV stored in the CPU tier, its transcript
kept) when it has been idle for ``session_park_after_s``, and at once, least
recently used first, when a chunk or any other request would not fit on the
device beside the sessions that hold it (see ``admission``). A chunk that still
does not fit waits at most ``admission_timeout_s`` for room, then gets 503
``server_busy`` with ``Retry-After``; the session is left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind

from app.engine import scheduler_observer
from app.errors import APIError, session_not_found
from app.metrics import SessionMetrics, session_metrics
from app.provenance import ProvenanceRecorder
from app.sessions.admission import DeviceCapacity
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
# How often the service checks that what the device holds fits it (requests
# other than session chunks do not pass through admission).
CAPACITY_CHECK_S = 0.2


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
        self._tasks: list[asyncio.Task[None]] = []
        self.capacity = DeviceCapacity.of(engine)
        self._observer = scheduler_observer(engine)
        # Admission decisions (check, park, reserve) run one at a time.
        self._admission = asyncio.Lock()
        # Set whenever device capacity is freed: a chunk waiting for room re-checks.
        self._capacity_freed = asyncio.Event()
        self._barrier_ids = itertools.count()

    @classmethod
    def on_engine(
        cls, engine: Any, settings: Settings, recorder: ProvenanceRecorder | None = None
    ) -> SessionService:
        """The service as the server builds it: the served model's name, the engine's
        tokenizer, the process-wide metrics, and a provenance recorder attached to
        the engine (``service.recorder``; pass one already attached to reuse it)."""
        if recorder is None:
            recorder = ProvenanceRecorder()
            recorder.attach(engine)
        return cls(
            engine=engine,
            settings=settings,
            model_name=settings.resolved_served_model_name(),
            tokenizer=engine.get_tokenizer(),
            metrics=session_metrics(),
            recorder=recorder,
        )

    @property
    def recorder(self) -> ProvenanceRecorder | None:
        return self._recorder

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._reap_idle(), name="session-reaper"),
            asyncio.create_task(self._keep_device_within_capacity(), name="session-capacity"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(
            *(self._close(s, "server_shutdown") for s in list(self._sessions.values())),
            return_exceptions=True,
        )

    async def _reap_idle(self) -> None:
        close_after = self._settings.session_idle_timeout_s
        park_after = self._settings.session_park_after_s
        interval = min(5.0, max(min(close_after, park_after) / 4, 0.05))
        while True:
            await asyncio.sleep(interval)
            now = time.time()
            for session in list(self._sessions.values()):
                idle_for = now - session.last_activity
                if session.status in ("active", "parked") and not session.lock.locked() and idle_for > close_after:
                    logger.info("session %s idle for %.0fs: closing", session.id, idle_for)
                    await self._close(session, "expired")
            idle = [s for s in self._sessions.values() if s.idle and now - s.last_activity > park_after]
            if idle:
                await self._park(idle, "idle")

    async def _keep_device_within_capacity(self) -> None:
        """Park idle sessions while the device is over capacity: requests that are
        not session chunks (vLLM's OpenAI endpoints) would otherwise wait forever
        behind idle sessions. Backstop for the estimate: when vLLM's scheduler
        reports requests waiting and none running at two checks in a row, whatever
        the estimate says, the least recently used idle session is parked."""
        stalled_checks = 0
        while True:
            await asyncio.sleep(CAPACITY_CHECK_S)
            observer = self._observer
            stalled_checks = stalled_checks + 1 if observer is not None and observer.stalled else 0
            async with self._admission:
                await self._park_until(
                    lambda: not self.capacity.over(self.capacity.load(self._engine, self._sessions.values())),
                    "capacity",
                )
                if stalled_checks >= 2 and (victim := self._least_recently_used_idle()) is not None:
                    await self._park([victim], "stalled")
                    stalled_checks = 0

    # ------------------------------------------------------------------ parking
    def _least_recently_used_idle(self, exclude: StreamingSession | None = None) -> StreamingSession | None:
        idle = [s for s in self._sessions.values() if s.idle and s is not exclude]
        return min(idle, key=lambda s: s.last_activity, default=None)

    async def _park_until(
        self, fits: Callable[[], bool], reason: str, exclude: StreamingSession | None = None
    ) -> bool:
        """Park idle sessions, least recently used first, until ``fits()``; False
        when none is left to park and it still does not fit."""
        while not fits():
            victim = self._least_recently_used_idle(exclude)
            if victim is None or not await self._park([victim], reason):
                return False
        return True

    async def park(self, owner: str, session_id: str) -> StreamingSession:
        """Park one session now (a client's, an operator's or a test's call), and
        return once the CPU tier holds its whole context (see tier_barrier)."""
        session = self.get(owner, session_id)
        if await self._park([session], "requested"):
            await self.tier_barrier()
        return session

    async def _park(self, sessions: list[StreamingSession], reason: str) -> bool:
        """Park the idle ones of ``sessions``; True when any parked. The engine
        stores their last blocks in its next step, by itself; nothing here waits
        for that (the parks that make room must not wait for room)."""
        taken = [s for s in sessions if s.idle and not s.lock.locked()]
        for session in taken:
            await session.lock.acquire()
            session.parking = True
        try:
            parked = [s for s, ok in zip(taken, await asyncio.gather(*(s.park() for s in taken))) if ok]
        finally:
            for session in taken:
                session.parking = False
                session.lock.release()
        for session in parked:
            logger.info("session %s parked (%s) with %d tokens", session.id, reason, len(session.token_ids))
            self._metrics.session_parks.labels(reason).inc()
        if parked:
            self._update_gauges()
            self._capacity_freed.set()
        return bool(parked)

    async def tier_barrier(self) -> None:
        """Return after one more engine step, so that every session parked before
        the call is whole in the CPU tier. vLLM builds an ended request's last
        store jobs in the step after its end, and our host tier copies inside that
        step: a 1-token request that has been answered comes after them. Call it
        before dropping the device cache (the admin reset does)."""
        request_id = f"streamsess-park-barrier-{next(self._barrier_ids)}"
        params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True)
        async for _ in self._engine.generate(
            prompt=tokens_input([0]), sampling_params=params, request_id=request_id
        ):
            pass
        if self._recorder is not None:
            self._recorder.pop(request_id)

    async def _admit(self, session: StreamingSession, input_ids: list[int], params: SamplingParams) -> None:
        """Make room on the device for this chunk, parking idle sessions as needed,
        and reserve it. Waits at most ``admission_timeout_s`` for room."""
        tokens = len(session.token_ids) + len(input_ids) + (params.max_tokens or 0)
        deadline = time.monotonic() + self._settings.admission_timeout_s
        while True:
            async with self._admission:
                self._capacity_freed.clear()
                if await self._park_until(
                    lambda: self.capacity.fits(self.capacity.load(self._engine, self._sessions.values(), session), tokens),
                    "admission",
                    exclude=session,
                ):
                    session.device_tokens = tokens  # reserved until the chunk ends
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._metrics.chunk_errors.labels("server_busy").inc()
                retry_after = max(1, round(self._settings.admission_timeout_s))
                raise APIError(
                    503,
                    "The engine has no room for this chunk now: every slot or KV block is held by "
                    "requests in flight. The session is unchanged; retry later.",
                    code="server_busy", headers={"Retry-After": str(retry_after)},
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._capacity_freed.wait(), remaining)

    def _update_gauges(self) -> None:
        sessions = self._sessions.values()
        self._metrics.sessions_open.set(len(self._sessions))
        self._metrics.sessions_parked.set(sum(s.status == "parked" for s in sessions))
        self._metrics.sessions_with_engine_request.set(sum(s.has_engine_request for s in sessions))

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
        self._update_gauges()
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
        # A session being parked is not busy: its chunk waits the few milliseconds.
        if not wait and session.lock.locked() and not session.parking:
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
            await self._admit(session, prepared.input_ids, prepared.params)
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
            if not session.has_engine_request:
                session.device_tokens = 0  # admitted, but failed before it ran
            session.lock.release()
            if session.closed:
                self._forget(session)
            self._update_gauges()
            self._capacity_freed.set()

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
        if result.resumed_from is not None:
            metrics.session_resumes.labels(result.resumed_from).inc()
            if result.time_to_first_token is not None:
                metrics.resume_ttft.labels(result.resumed_from).observe(result.time_to_first_token)
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
            self._update_gauges()
            self._capacity_freed.set()
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
