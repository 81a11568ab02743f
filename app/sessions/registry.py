"""The sessions this server holds, and their replication to the store.

Held sessions are in memory; closed ones are remembered as records (a late request
gets "closed", not "unknown"); a session held by no server here (after a restart, or
one another replica served) is loaded from the store, parked. Replicas sharing a
database take a lease per chunk, so one session is extended by one replica at a time,
and a chunk's tokens are committed to the store before its answer completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from app import routing
from app.errors import APIError, session_not_found
from app.metrics import SessionMetrics
from app.protocol import SessionCreateRequest, SessionDefaults, SessionObject
from app.provenance import ProvenanceRecorder
from app.sessions import errors
from app.sessions.chat import ChatState
from app.sessions.chunk import ChunkResult
from app.sessions.errors import DELETED
from app.sessions.inputs import SESSION_ID, check_session_id
from app.sessions.session import StreamingSession
from app.settings import Settings
from app.store import (
    LeaseRefused,
    SessionExistsError,
    SessionRecord,
    SessionStore,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

# Closed sessions are remembered this many at a time, so a late append gets
# "closed (expired)" rather than "unknown".
CLOSED_SESSIONS_KEPT = 1024


class SessionRegistry:
    def __init__(
        self,
        engine: Any,
        settings: Settings,
        model_name: str,
        metrics: SessionMetrics,
        store: SessionStore,
        recorder: ProvenanceRecorder | None,
        cache_salt: Callable[[str], str | None],
        max_context: int,
        on_freed: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._settings = settings
        self.model_name = model_name
        self._metrics = metrics
        self.store = store
        self._recorder = recorder
        self._cache_salt = cache_salt
        self.max_context = max_context
        self._on_freed = on_freed  # device capacity was freed: waiting chunks re-check
        self._replica = settings.resolved_replica_id()
        self.held: dict[str, StreamingSession] = {}
        # The sessions that hold or have reserved room on the device: each adds and
        # removes itself as its device_tokens change (admission.DeviceTokens), nowhere else.
        self.device_holders: set[StreamingSession] = set()
        self._closed: OrderedDict[str, SessionRecord] = OrderedDict()
        self._count_sessions_when_scraped()

    # ------------------------------------------------------------------ lookup
    async def create(
        self, owner: str, request: SessionCreateRequest, session_id: str | None, route_key: str | None = None
    ) -> StreamingSession:
        if session_id is not None:
            check_session_id(session_id)
            if session_id in self.held or session_id in self._closed:
                raise errors.session_exists(session_id)
        self._check_room()
        session = StreamingSession(
            session_id=session_id or routing.mint("sess", route_key),
            owner=owner,
            model=self.model_name,
            engine=self._engine,
            defaults=request.defaults,
            metadata=dict(request.metadata),
            max_tokens=self.max_context,
            recorder=self._recorder,
            cache_salt=self._cache_salt(owner),
            device_holders=self.device_holders,
        )
        try:
            async with self.store_errors():
                await self.store.create(session.record())
        except SessionExistsError:
            raise errors.session_exists(session.id) from None
        self.held[session.id] = session
        self._metrics.sessions_total.inc()
        return session

    def _check_room(self) -> None:
        if len(self.held) >= self._settings.max_sessions:
            raise APIError(
                429,
                f"The server holds its maximum of {self._settings.max_sessions} open sessions; "
                "close one or retry later.",
                code="too_many_sessions",
            )

    async def reopen(self, owner: str, session_id: str) -> StreamingSession:
        """A session closed for being idle (``expired``), open again as it was, parked:
        its transcript and conversation are in the store until it is purged. For
        conversations, which OpenAI keeps however long they are idle. A session closed
        for any other reason stays closed."""
        session = await self.get(owner, session_id, include_closed=True)
        if not session.closed:
            return session
        if session.close_reason != errors.EXPIRED or not self.store.durable:
            raise errors.session_closed(session.id, session.close_reason)
        self._check_room()
        async with self.store_errors():
            await self.store.update(session.id, status="active", close_reason=None, last_activity=time.time())
        self._closed.pop(session.id, None)
        reopened = await self._load(session.id)
        if reopened is None or reopened.closed:  # purged, or closed again meanwhile
            raise errors.session_closed(session.id, session.close_reason)
        logger.info("session %s: reopened after it expired", session.id)
        return reopened

    async def get(self, owner: str, session_id: str, *, include_closed: bool = False) -> StreamingSession:
        session = self.held.get(session_id)
        if session is None:
            session = self._closed_session(session_id) or await self._load(session_id)
            if session is not None and session.closed and not include_closed:
                session = None
        # Another key's session is "not found": its existence is not ours to reveal.
        # A deleted one too, as OpenAI's deleted objects are (a session closed for any
        # other reason stays visible, status "closed" and its reason).
        if session is None or session.owner != owner or session.close_reason == DELETED:
            raise session_not_found(session_id)
        return session

    async def open_session(self, owner: str, session_id: str) -> StreamingSession:
        session = await self.get(owner, session_id, include_closed=True)
        if session.closed:
            raise errors.session_closed(session.id, session.close_reason)
        return session

    async def _load(self, session_id: str) -> StreamingSession | None:
        """A session from the store, parked (or closed), now held here too."""
        if not self.store.durable or not SESSION_ID.fullmatch(session_id):
            return None
        async with self.store_errors():
            loaded = await self.store.load(session_id)
        if loaded is None:
            return None
        if (held := self.held.get(session_id) or self._closed_session(session_id)) is not None:
            return held  # loaded meanwhile by a concurrent request
        record, transcript = loaded
        session = StreamingSession.from_record(
            record,
            transcript,
            engine=self._engine,
            max_tokens=self.max_context,
            recorder=self._recorder,
            cache_salt=self._cache_salt(record.owner),
            device_holders=self.device_holders,
        )
        if session.closed:
            self._remember_closed(session)
        else:
            self.held[session.id] = session
        return session

    async def current(self, owner: str, session_id: str) -> StreamingSession:
        """The session as the store has it now (``get`` answers from memory): a copy
        here that another replica has extended or closed since is brought up to
        date first. For reads that must be current across replicas."""
        session = await self.get(owner, session_id, include_closed=True)
        if not self.store.durable or session.closed or session.lock.locked():
            return session
        try:
            record = await self.store.get(session.id)
        except StoreUnavailableError:
            return session  # reads go on from memory while the store is down
        if record is None or record.status == "closed":
            session.terminate((record.close_reason or "closed_elsewhere") if record else DELETED)
            self.forget(session)
        elif record.num_chunks != session.num_chunks:
            with contextlib.suppress(StoreUnavailableError):
                if (loaded := await self.store.load(session.id)) is not None:
                    await self._adopt(session, *loaded)
        return session

    async def _adopt(self, session: StreamingSession, record: SessionRecord, transcript: list[int]) -> None:
        """Take the store's newer state of a session another replica extended: the
        engine request here, if any, holds an older context and is dropped."""
        logger.info(
            "session %s: extended elsewhere (%d -> %d chunks), reloaded",
            session.id,
            session.num_chunks,
            record.num_chunks,
        )
        await session.restart_from(transcript, record.num_chunks)
        session.chat = ChatState.load(record.chat)
        session.defaults = SessionDefaults(**record.defaults)
        session.last_activity = record.last_activity

    async def list_sessions(self, owner: str) -> list[SessionObject]:
        """The owner's open sessions: from the store when there is one, so every
        replica lists every replica's sessions."""
        if not self.store.durable:
            return [self.describe(s) for s in self.held.values() if s.owner == owner and not s.closed]
        async with self.store_errors():
            records = await self.store.list_open(owner)
        listed = []
        for record in records:
            if (held := self.held.get(record.id)) is None:
                listed.append(self._describe_record(record))
            elif not held.closed:  # one this replica is closing is not open, whatever its row says yet
                listed.append(self.describe(held))
        return listed

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
            max_tokens=self.max_context,
            last_activity_at=record.last_activity,
            expires_at=None if closed else record.last_activity + self._settings.session_idle_timeout_s,
        )

    # ------------------------------------------------------------------ forgetting
    def forget(self, session: StreamingSession) -> None:
        if self.held.pop(session.id, None) is not None:
            self._metrics.sessions_closed.labels(session.close_reason or "closed").inc()
            self._on_freed()
            self._remember_closed(session)
            self.store.forget_session(session.id)

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
        return StreamingSession.from_record(record, [], engine=self._engine, max_tokens=self.max_context)

    def _count_sessions_when_scraped(self) -> None:
        """The session gauges, counted when /metrics is read rather than on every chunk
        (a pass over every held session each time)."""
        held = self.held
        self._metrics.sessions_open.set_function(lambda: len(held))
        self._metrics.sessions_parked.set_function(lambda: sum(s.status == "parked" for s in held.values()))
        self._metrics.sessions_with_engine_request.set_function(
            lambda: sum(s.has_engine_request for s in held.values())
        )

    # ------------------------------------------------------------------ store
    @contextlib.asynccontextmanager
    async def store_errors(self) -> AsyncIterator[None]:
        """The store's failures as the client sees them: 503, nothing changed."""
        try:
            yield
        except StoreUnavailableError as exc:
            logger.warning("session store unavailable: %s", exc)
            raise errors.store_unavailable() from exc

    async def take_lease(self, session: StreamingSession) -> bool:
        """Take the session's chunk lease in the store (False: no store). If another
        replica extended the session since this one last saw it, the transcript is
        reloaded and any engine request here, now stale, is dropped."""
        if not self.store.durable:
            return False
        async with self.store_errors():
            granted = await self.store.acquire_lease(session.id, self._replica, self._settings.session_lease_s)
        if granted is LeaseRefused.HELD:
            raise errors.chunk_in_flight()
        if isinstance(granted, LeaseRefused):
            # Closed or deleted by another replica (or expired in the store).
            session.terminate("closed_elsewhere" if granted is LeaseRefused.CLOSED else DELETED)
            self.forget(session)
            raise errors.session_closed(session.id, session.close_reason)
        if granted.num_chunks != session.num_chunks:
            try:
                async with self.store_errors():
                    loaded = await self.store.load(session.id)
            except APIError:
                await self.release_lease(session)
                raise
            assert loaded is not None
            await self._adopt(session, *loaded)
        return True

    async def hold_lease(self, session: StreamingSession) -> asyncio.Task[None] | None:
        """Take the session's chunk lease and keep it renewed, in the task returned (None:
        no store). To give it up: cancel the task, then ``release_lease``."""
        if not await self.take_lease(session):
            return None
        return asyncio.create_task(self.renew_lease(session), name=f"lease-{session.id}")

    async def renew_lease(self, session: StreamingSession) -> None:
        """Renew the chunk's lease while it runs (a task, cancelled at the chunk's end)."""
        interval = self._settings.session_lease_s / 3
        while True:
            await asyncio.sleep(interval)
            with contextlib.suppress(StoreUnavailableError):
                await self.store.renew_lease(session.id, self._replica, self._settings.session_lease_s)

    async def release_lease(self, session: StreamingSession) -> None:
        # Best effort: an unreleased lease expires by itself.
        with contextlib.suppress(StoreUnavailableError):
            await self.store.release_lease(session.id, self._replica)

    async def commit(
        self,
        session: StreamingSession,
        result: ChunkResult,
        context_before: int,
        transcript_before: list[int] | None = None,
    ) -> None:
        """Write the chunk's tokens to the store (a chunk that cut the context, with
        where it starts). If the store does not take them, the chunk is undone (its
        engine request aborted, the transcript as before: ``transcript_before`` for a
        chunk that cut it) and the client gets an error instead of the chunk's end."""
        if not self.store.durable:
            return
        first = context_before if result.start is None else result.start
        try:
            committed: bool | None = await self.store.commit_chunk(
                session.id,
                self._replica,
                result.index,
                session.token_ids[first:],
                session.last_activity,
                start=result.start,
                chat=None if session.chat is None else session.chat.dump(),
            )
        except StoreUnavailableError as exc:
            logger.warning("session %s: chunk %d not committed: %s", session.id, result.index, exc)
            committed = None
        if committed:
            return
        before = transcript_before if transcript_before is not None else session.token_ids[:context_before]
        await session.restart_from(before, result.index)
        if committed is None:
            raise errors.chunk_not_kept()
        raise errors.chunk_in_flight()  # the lease expired and another replica took the session

    async def persist_close(self, session: StreamingSession) -> None:
        with contextlib.suppress(StoreUnavailableError):
            await self.store.update(
                session.id, status="closed", close_reason=session.close_reason, last_activity=time.time()
            )
