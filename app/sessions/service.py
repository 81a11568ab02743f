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

Sessions are durable when a store is configured (``app.store``): a session's row
and transcript are written as it changes, a chunk's tokens are committed before its
answer completes, and a session this server does not hold in memory (after a
restart, or one another replica served) is loaded from the store, parked. Replicas
sharing a database take a lease per chunk, so one session is extended by one
replica at a time.
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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams
from vllm.inputs.engine import tokens_input
from vllm.sampling_params import RequestOutputKind

from app.cache_salt import CacheSalter, cache_salter
from app.engine import scheduler_observer
from app.errors import APIError, session_not_found
from app.limits import KeyLimits
from app.metrics import SessionMetrics, session_metrics
from app.provenance import ProvenanceRecorder
from app.sessions.admission import DeviceCapacity
from app.sessions.protocol import (
    SAMPLING_FIELDS,
    SESSION_ID_PATTERN,
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
from app.store import (
    LeaseRefused,
    NullStore,
    SessionExistsError,
    SessionRecord,
    SessionStore,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
SESSION_ID = re.compile(SESSION_ID_PATTERN)
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
    # Renews the chunk's lease in the store while it runs (durable stores only).
    lease_renewal: asyncio.Task[None] | None = None
    # Set to end the answer early, keeping the session (see StreamingSession.generate).
    stop: asyncio.Event = field(default_factory=asyncio.Event)


class SessionService:
    def __init__(
        self,
        engine: Any,
        settings: Settings,
        model_name: str,
        tokenizer: Any,
        metrics: SessionMetrics,
        recorder: ProvenanceRecorder | None = None,
        store: SessionStore | None = None,
        salter: CacheSalter | None = None,
        limits: KeyLimits | None = None,
    ):
        self._engine = engine
        self._settings = settings
        self.model_name = model_name
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._recorder = recorder
        self._store = store if store is not None else NullStore()
        self._salter = salter
        self.limits = limits if limits is not None else KeyLimits(settings)
        self._replica = settings.resolved_replica_id()
        self._vocab_size = engine.model_config.get_vocab_size()
        self._max_context = min(settings.max_model_len, engine.model_config.max_model_len)
        self._sessions: dict[str, StreamingSession] = {}
        self._closed: OrderedDict[str, SessionRecord] = OrderedDict()
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
        cls, engine: Any, settings: Settings, recorder: ProvenanceRecorder | None = None,
        store: SessionStore | None = None, limits: KeyLimits | None = None,
    ) -> SessionService:
        """The service as the server builds it: the served model's name, the engine's
        tokenizer, the process-wide metrics, the store of the settings (or ``store``),
        and a provenance recorder attached to the engine (``service.recorder``; pass
        one already attached to reuse it)."""
        from app.store import open_store

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
            store=store if store is not None else open_store(settings),
            salter=cache_salter(settings),
            limits=limits,
        )

    @property
    def recorder(self) -> ProvenanceRecorder | None:
        return self._recorder

    def cache_salt(self, owner: str) -> str | None:
        """The owner's prefix-cache namespace, or None where keys share one."""
        return self._salter.salt(owner) if self._salter is not None else None

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_chunk_output_tokens(self) -> int:
        return self._settings.max_chunk_output_tokens

    # ------------------------------------------------------------------ lifecycle
    @property
    def store(self) -> SessionStore:
        return self._store

    async def start(self) -> None:
        await self._store.start()
        self._tasks = [
            asyncio.create_task(self._reap_idle(), name="session-reaper"),
            asyncio.create_task(self._keep_device_within_capacity(), name="session-capacity"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Sessions end here, not in the store: a durable one is there, parked, for the next server.
        await asyncio.gather(
            *(self._close(s, "server_shutdown", persist=False) for s in list(self._sessions.values())),
            return_exceptions=True,
        )
        await self._store.close()

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
            # Sessions no replica holds (their server is gone) expire in the store.
            with contextlib.suppress(StoreUnavailableError):
                await self._store.expire(now - close_after, now - self._settings.closed_session_retention_s)

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
        session = await self.get(owner, session_id)
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
    async def create(
        self, owner: str, request: SessionCreateRequest, session_id: str | None = None
    ) -> StreamingSession:
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
            cache_salt=self.cache_salt(owner),
        )
        try:
            async with self._store_errors():
                await self._store.create(session.record())
        except SessionExistsError:
            raise self._session_exists(session.id) from None
        self._sessions[session.id] = session
        self._metrics.sessions_total.inc()
        self._update_gauges()
        return session

    async def get(self, owner: str, session_id: str, *, include_closed: bool = False) -> StreamingSession:
        session = self._sessions.get(session_id)
        if session is None:
            session = self._closed_session(session_id) or await self._load(session_id)
            if session is not None and session.closed and not include_closed:
                session = None
        # Another key's session is "not found": its existence is not ours to reveal.
        if session is None or session.owner != owner:
            raise session_not_found(session_id)
        return session

    async def _load(self, session_id: str) -> StreamingSession | None:
        """A session from the store, parked (or closed), now held here too."""
        if not self._store.durable or not SESSION_ID.fullmatch(session_id):
            return None
        async with self._store_errors():
            loaded = await self._store.load(session_id)
        if loaded is None:
            return None
        if (held := self._sessions.get(session_id) or self._closed_session(session_id)) is not None:
            return held  # loaded meanwhile by a concurrent request
        record, transcript = loaded
        session = StreamingSession.from_record(
            record, transcript, engine=self._engine, max_tokens=self._max_context, recorder=self._recorder,
            cache_salt=self.cache_salt(record.owner),
        )
        if session.closed:
            self._remember_closed(session)
        else:
            self._sessions[session.id] = session
            self._update_gauges()
        return session

    async def current(self, owner: str, session_id: str) -> StreamingSession:
        """The session as the store has it now (``get`` answers from memory): a copy
        here that another replica has extended or closed since is brought up to
        date first. For reads that must be current across replicas."""
        session = await self.get(owner, session_id, include_closed=True)
        if not self._store.durable or session.closed or session.lock.locked():
            return session
        try:
            record = await self._store.get(session.id)
        except StoreUnavailableError:
            return session  # reads go on from memory while the store is down
        if record is None or record.status == "closed":
            session.terminate((record.close_reason or "closed_elsewhere") if record else "deleted")
            self._forget(session)
        elif record.num_chunks != session.num_chunks:
            with contextlib.suppress(StoreUnavailableError):
                if (loaded := await self._store.load(session.id)) is not None:
                    await self._adopt(session, *loaded)
        return session

    async def _adopt(self, session: StreamingSession, record: SessionRecord, transcript: list[int]) -> None:
        """Take the store's newer state of a session another replica extended: the
        engine request here, if any, holds an older context and is dropped."""
        logger.info("session %s: extended elsewhere (%d -> %d chunks), reloaded", session.id,
                    session.num_chunks, record.num_chunks)
        await session.restart_from(transcript, record.num_chunks)
        session.defaults = SessionDefaults(**record.defaults)
        session.last_activity = record.last_activity

    async def list_sessions(self, owner: str) -> list[SessionObject]:
        """The owner's open sessions: from the store when there is one, so every
        replica lists every replica's sessions."""
        if not self._store.durable:
            return [self.describe(s) for s in self._sessions.values() if s.owner == owner]
        async with self._store_errors():
            records = await self._store.list_open(owner)
        held = self._sessions
        return [self.describe(held[r.id]) if r.id in held else self._describe_record(r) for r in records]

    def describe(self, session: StreamingSession) -> SessionObject:
        described = self._describe_record(session.record())
        described.status = session.status
        return described

    def _describe_record(self, record: SessionRecord) -> SessionObject:
        closed = record.status == "closed"
        return SessionObject(
            id=record.id,
            model=record.model,
            created=int(record.created),
            # A session held by no server here has no engine request: parked.
            status="closed" if closed else "parked",
            close_reason=record.close_reason,
            defaults=SessionDefaults(**record.defaults),
            metadata=record.metadata,
            num_chunks=record.num_chunks,
            num_tokens=record.num_tokens,
            max_tokens=self._max_context,
            last_activity_at=record.last_activity,
            expires_at=None if closed else record.last_activity + self._settings.session_idle_timeout_s,
        )

    async def update_defaults(self, owner: str, session_id: str, defaults: SessionDefaults) -> StreamingSession:
        session = await self._open_session(owner, session_id)
        self._check_sampling(defaults, "session")
        merged = session.defaults.model_dump(exclude_none=True) | defaults.model_dump(exclude_none=True)
        now = time.time()
        async with self._store_errors():
            await self._store.update(session.id, defaults=merged, last_activity=now)
        session.defaults = SessionDefaults(**merged)
        session.last_activity = now
        return session

    async def transcript(self, owner: str, session_id: str) -> tuple[StreamingSession, str]:
        session = await self.current(owner, session_id)
        return session, self._tokenizer.decode(session.token_ids)

    @contextlib.asynccontextmanager
    async def _store_errors(self) -> AsyncIterator[None]:
        """The store's failures as the client sees them: 503, nothing changed."""
        try:
            yield
        except StoreUnavailableError as exc:
            logger.warning("session store unavailable: %s", exc)
            self._metrics.chunk_errors.labels("store_unavailable").inc()
            raise APIError(
                503, "The session store is unavailable; nothing was changed. Retry later.",
                code="store_unavailable", headers={"Retry-After": "1"},
            ) from exc

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
        """Validate a chunk, take the session's lock and lease, and admit it onto
        the device. Every refusal comes from here, before a response has begun.

        ``wait=False`` (REST) refuses a second chunk in flight with 409;
        ``wait=True`` (websocket) queues behind it, in order.
        """
        session = await self._open_session(owner, session_id)
        input_ids = self._encode(chunk_input)
        params = self._sampling_params(session, options)
        self._check_chunk(session, input_ids, params)
        await self.limits.charge_tokens(owner, len(input_ids) + (params.max_tokens or 0))
        if not wait and session.answering:
            raise self._chunk_in_flight()
        await session.lock.acquire()
        leased = False
        try:
            # Re-check after waiting: the session may have closed or grown meanwhile.
            if session.closed:
                raise self._closed_error(session)
            leased = await self._take_lease(session)
            params = self._sampling_params(session, options)  # defaults may have changed elsewhere
            self._check_chunk(session, input_ids, params)
            await self._admit(session, input_ids, params)
        except BaseException:
            if leased:
                await self._release_lease(session)
            session.lock.release()
            raise
        renewal = asyncio.create_task(self._renew_lease(session)) if leased else None
        return PreparedChunk(session, input_ids, params, transport, renewal)

    async def stream_chunk(self, prepared: PreparedChunk) -> AsyncGenerator[ChunkDelta | ChunkResult, None]:
        """Run a prepared chunk, commit it to the store before its result is
        yielded, and release the session's lock (and lease) at the end."""
        session = prepared.session
        context_before = len(session.token_ids)
        committed = False
        try:
            async for event in session.generate(prepared.input_ids, prepared.params, prepared.stop):
                if isinstance(event, ChunkResult):
                    await self._commit(session, event, context_before)
                    committed = True
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
            # This runs while the consumer is cancelled (a client that went away),
            # where every await may be cancelled again: the store writes are
            # shielded, and the lock is released whatever they do.
            try:
                if prepared.lease_renewal is not None:
                    prepared.lease_renewal.cancel()
                    if not committed:
                        await asyncio.shield(self._release_lease(session))
            finally:
                if not session.has_engine_request:
                    session.device_tokens = 0  # admitted, but failed before it ran
                session.lock.release()
                self._update_gauges()
                self._capacity_freed.set()
                if session.closed:
                    self._forget(session)
                    await asyncio.shield(self._persist_close(session))

    async def run_chunk(self, prepared: PreparedChunk) -> ChunkResult:
        """Run a prepared chunk to its end."""
        result: ChunkResult | None = None
        async with contextlib.aclosing(self.stream_chunk(prepared)) as events:
            async for event in events:
                if isinstance(event, ChunkResult):
                    result = event
        assert result is not None
        return result

    # ------------------------------------------------------------------ store
    async def _take_lease(self, session: StreamingSession) -> bool:
        """Take the session's chunk lease in the store (False: no store). If another
        replica extended the session since this one last saw it, the transcript is
        reloaded and any engine request here, now stale, is dropped."""
        if not self._store.durable:
            return False
        async with self._store_errors():
            granted = await self._store.acquire_lease(session.id, self._replica, self._settings.session_lease_s)
        if granted is LeaseRefused.HELD:
            raise self._chunk_in_flight()
        if isinstance(granted, LeaseRefused):
            # Closed or deleted by another replica (or expired in the store).
            session.terminate("closed_elsewhere" if granted is LeaseRefused.CLOSED else "deleted")
            self._forget(session)
            raise self._closed_error(session)
        if granted.num_chunks != session.num_chunks:
            try:
                async with self._store_errors():
                    loaded = await self._store.load(session.id)
            except APIError:
                await self._release_lease(session)
                raise
            assert loaded is not None
            await self._adopt(session, *loaded)
        return True

    async def _renew_lease(self, session: StreamingSession) -> None:
        interval = self._settings.session_lease_s / 3
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(StoreUnavailableError):
                await self._store.renew_lease(session.id, self._replica, self._settings.session_lease_s)

    async def _release_lease(self, session: StreamingSession) -> None:
        # Best effort: an unreleased lease expires by itself.
        with contextlib.suppress(StoreUnavailableError):
            await self._store.release_lease(session.id, self._replica)

    async def _commit(self, session: StreamingSession, result: ChunkResult, context_before: int) -> None:
        """Write the chunk's tokens to the store. If the store does not take them,
        the chunk is undone (its engine request aborted, the transcript as before)
        and the client gets an error instead of the chunk's end."""
        if not self._store.durable:
            return
        try:
            committed: bool | None = await self._store.commit_chunk(
                session.id, self._replica, result.index, session.token_ids[context_before:], session.last_activity
            )
        except StoreUnavailableError as exc:
            logger.warning("session %s: chunk %d not committed: %s", session.id, result.index, exc)
            committed = None
        if committed:
            return
        await session.restart_from(session.token_ids[:context_before], result.index)
        if committed is None:
            self._metrics.chunk_errors.labels("store_unavailable").inc()
            raise APIError(
                503, "The session store is unavailable: this chunk was not kept, and the session is as "
                "it was before it. Retry later.", code="store_unavailable", headers={"Retry-After": "1"},
            )
        raise self._chunk_in_flight()  # the lease expired and another replica took the session

    async def _persist_close(self, session: StreamingSession) -> None:
        with contextlib.suppress(StoreUnavailableError):
            await self._store.update(
                session.id, status="closed", close_reason=session.close_reason, last_activity=time.time()
            )

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
        session = await self.get(owner, session_id)
        # The store first: if it is down, the session stays open everywhere.
        async with self._store_errors():
            await self._store.update(session.id, status="closed", close_reason=reason, last_activity=time.time())
        await self._close(session, reason, persist=False)
        return session

    async def abort(self, session: StreamingSession, reason: str) -> None:
        """Abort at once, e.g. when a client vanished mid-chunk."""
        session.terminate(reason)
        await self._close(session, reason)

    async def _close(self, session: StreamingSession, reason: str, persist: bool = True) -> None:
        await session.close(reason)
        if persist:
            await self._persist_close(session)
        if not session.lock.locked():
            self._forget(session)

    def _forget(self, session: StreamingSession) -> None:
        if self._sessions.pop(session.id, None) is not None:
            self._metrics.sessions_closed.labels(session.close_reason or "closed").inc()
            self._update_gauges()
            self._capacity_freed.set()
            self._remember_closed(session)

    def _remember_closed(self, session: StreamingSession) -> None:
        # Kept to answer for its id (409 session_closed, GET) as its record, not the
        # session: no transcript (a thousand long ones would hold gigabytes), no queues
        # nor engine task (about 12 kB a session, measured in the soak).
        session.forget_transcript()
        self._closed[session.id] = session.record()
        while len(self._closed) > CLOSED_SESSIONS_KEPT:
            self._closed.popitem(last=False)

    def _closed_session(self, session_id: str) -> StreamingSession | None:
        record = self._closed.get(session_id)
        if record is None:
            return None
        return StreamingSession.from_record(record, [], engine=self._engine, max_tokens=self._max_context)

    # ------------------------------------------------------------------ checks
    def _check_session_id(self, session_id: str) -> None:
        if not SESSION_ID.fullmatch(session_id):
            raise APIError(
                400, "A session id is 1 to 128 letters, digits, '_', '-' or '.', starting with a letter or digit.",
                code="invalid_session_id", param="X-Session-ID",
            )
        if session_id in self._sessions or session_id in self._closed:
            raise self._session_exists(session_id)

    @staticmethod
    def _session_exists(session_id: str) -> APIError:
        return APIError(409, f"A session with id {session_id!r} exists already.", code="session_exists",
                        param="X-Session-ID")

    def _chunk_in_flight(self) -> APIError:
        self._metrics.chunk_errors.labels("chunk_in_flight").inc()
        return APIError(
            409, "This session is already answering a chunk; send the next one when it is done.",
            code="chunk_in_flight",
        )

    async def _open_session(self, owner: str, session_id: str) -> StreamingSession:
        session = await self.get(owner, session_id, include_closed=True)
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
