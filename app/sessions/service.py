"""SessionService: the one facade transports call to open, extend, park and close sessions.

No FastAPI here, and every limit lives here, so every transport enforces the same
ones; every refusal is an ``APIError`` in the OpenAI shape, raised before a response
begins. The parts: ``registry`` (held sessions and their store), ``parking``
(admission and parking), ``inputs`` (pure checks), ``run`` (a chunk in flight, which
owns its lock, lease and reservation). A chunk's way: ``start_chunk`` checks, locks,
leases and admits, then returns a running ``ChunkRun``; its task runs ``_chunk_events``
(generate, commit, observe); its end, whatever it is, runs ``_release_chunk`` once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

from opentelemetry import trace

from app.cache_salt import CacheSalter
from app.errors import APIError
from app.limits import KeyLimits
from app.metrics import SchedulerObserver, SessionMetrics
from app.protocol import SamplingOptions, SessionCreateRequest, SessionDefaults, SessionObject
from app.provenance import ProvenanceRecorder
from app.sessions import chat, errors, inputs
from app.sessions.admission import DeviceCapacity
from app.sessions.chunk import ENGINE_ERROR, ChunkResult
from app.sessions.errors import ChunkRefusedError, SessionFailedError
from app.sessions.parking import Parking
from app.sessions.registry import SessionRegistry
from app.sessions.run import ChunkEvent, ChunkRun
from app.sessions.session import StreamingSession
from app.settings import Settings
from app.store import NullStore, SessionStore, StoreUnavailableError
from app.store.cluster import ClusterMembership

logger = logging.getLogger(__name__)
# Spans of a chunk (a no-op unless otlp_traces_endpoint is set: vLLM sets the provider).
tracer = trace.get_tracer("streamsess")


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
        observer: SchedulerObserver | None = None,
    ):
        self._engine = engine
        self._settings = settings
        self.model_name = model_name
        self.tokenizer = tokenizer
        self._metrics = metrics
        self.recorder = recorder
        self._salter = salter
        self.limits = limits if limits is not None else KeyLimits(settings)
        self.vocab_size = engine.model_config.get_vocab_size()
        self.max_model_len = engine.model_config.max_model_len  # the engine's, which vLLM's routes check
        self._model_sampling = inputs.model_sampling_defaults(engine.model_config)
        self.registry = SessionRegistry(
            engine,
            settings,
            model_name,
            metrics,
            store if store is not None else NullStore(),
            recorder,
            self.cache_salt,
            min(settings.max_model_len, engine.model_config.max_model_len),
            on_freed=lambda: self.parking.capacity_freed.set(),
        )
        self.parking = Parking(engine, self.registry, metrics, settings.admission_timeout_s, observer, recorder)
        self.membership = ClusterMembership(self.registry.store, settings, salter)
        self._runs: set[ChunkRun] = set()
        self._undelivered: set[ChunkRun] = set()  # runs whose consumer has not had their end
        self._tasks: list[asyncio.Task[None]] = []
        # Set once the server stops: connections that end then are not clients leaving.
        self.stopping = False
        # Set when the server starts draining: /ready fails at once (unready), new work is
        # refused a notice later (draining), chunks in flight finish.
        self.unready = False
        self.draining = False

    def cache_salt(self, owner: str) -> str | None:
        """The owner's prefix-cache namespace, or None where keys share one."""
        return self._salter.salt(owner) if self._salter is not None else None

    @property
    def max_chunk_output_tokens(self) -> int:
        return self._settings.max_chunk_output_tokens

    def declare_bounds(self, schema: dict[str, Any]) -> None:
        """This server's input bounds, in its published OpenAPI schema."""
        max_chunk_tokens = self._settings.max_chunk_tokens
        inputs.declare_bounds(
            schema,
            self.vocab_size,
            self.max_chunk_output_tokens,
            max_chunk_tokens,
            chat.max_messages(self.tokenizer, max_chunk_tokens),
        )

    @property
    def store(self) -> SessionStore:
        return self.registry.store

    @property
    def max_context(self) -> int:
        """The longest context a session may reach (the settings' and the engine's bound)."""
        return self.registry.max_context

    @property
    def capacity(self) -> DeviceCapacity:
        return self.parking.capacity

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.store.start()
        await self.membership.join()
        self._tasks = [
            asyncio.create_task(self.membership.beat(), name="replica-heartbeat"),
            asyncio.create_task(self._reap_idle(), name="session-reaper"),
            asyncio.create_task(self.parking.keep_device_within_capacity(), name="session-capacity"),
        ]

    async def stop(self) -> None:
        """A server stop is not a client leaving: chunks in flight are undone, idle
        sessions parked, and no session is closed in the store (the next server, or
        another replica, goes on with every one of them)."""
        self.stopping = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        runs = list(self._runs)
        for run in runs:
            run.cancel()
        await asyncio.gather(*(run.released for run in runs), return_exceptions=True)
        sessions = list(self.registry.held.values())
        with contextlib.suppress(Exception):
            await self.parking.park(sessions, "shutdown")
        await asyncio.gather(*(s.close("server_shutdown") for s in sessions), return_exceptions=True)
        await self.membership.leave()
        await self.store.close()

    async def drain(self, timeout_s: float, notice_s: float = 0.0) -> bool:
        """Fail readiness at once; ``notice_s`` later (time for a proxy's health checks to
        see it and stop sending), refuse new work (503 ``server_draining``, which a proxy
        retries on another replica); and let the chunks in flight finish and their ends
        reach their clients, for at most ``timeout_s`` in all; ``stop`` then undoes any
        still running and parks every session. True if every chunk finished in time."""
        self.unready = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        await asyncio.sleep(min(notice_s, timeout_s))
        self.draining = True
        while waits := [run.released for run in self._runs] + [run.delivered for run in self._undelivered]:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            await asyncio.wait([asyncio.ensure_future(wait) for wait in waits], timeout=left)
        return True

    async def not_ready(self) -> list[str]:
        """Why this server should get no new work now (empty: ready): draining, its
        engine dead, its store unreachable, or every session slot taken."""
        reasons = []
        if self.unready or self.stopping:  # draining is set after unready
            reasons.append("draining")
        if getattr(self._engine, "errored", False):
            reasons.append("engine_dead")
        try:
            await self.store.ping()
        except StoreUnavailableError:
            reasons.append("store_unavailable")
        if len(self.registry.held) >= self._settings.max_sessions:
            reasons.append("at_session_capacity")
        return reasons

    async def _reap_idle(self) -> None:
        close_after = self._settings.session_idle_timeout_s
        park_after = self._settings.session_park_after_s
        interval = min(5.0, max(min(close_after, park_after) / 4, 0.05))
        while True:
            await asyncio.sleep(interval)
            now = time.time()
            for session in list(self.registry.held.values()):
                idle_for = now - session.last_activity
                if session.status in ("active", "parked") and not session.lock.locked() and idle_for > close_after:
                    logger.info("session %s idle for %.0fs: closing", session.id, idle_for)
                    await self._close(session, errors.EXPIRED)
            await self.parking.park_idle(now - park_after, "idle")
            # Sessions no replica holds (their server is gone) expire in the store.
            with contextlib.suppress(APIError):
                async with self.registry.store_errors():
                    await self.store.expire(now - close_after, now - self._settings.closed_session_retention_s)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Every refusal and failure counted by its code."""
        try:
            yield
        except APIError as exc:
            self._metrics.chunk_errors.labels(exc.code).inc()
            raise

    # ------------------------------------------------------------------ sessions
    async def create(
        self, owner: str, request: SessionCreateRequest, session_id: str | None = None, route_key: str | None = None
    ) -> StreamingSession:
        """Open a session. ``session_id`` lets the client choose the id (the
        ``X-Session-ID`` header); otherwise the id is minted under ``route_key`` (the
        proxy's, ``app.routing``), so a proxy routes creation and every later request
        of the session to the same replica by hashing it."""
        with self._counted():
            self.refuse_if_draining()
            self.check_model(request.model)
            inputs.check_sampling(request.defaults, "defaults", self.max_chunk_output_tokens, self.vocab_size)
            return await self.registry.create(owner, request, session_id, route_key)

    async def get(self, owner: str, session_id: str, *, include_closed: bool = False) -> StreamingSession:
        return await self.registry.get(owner, session_id, include_closed=include_closed)

    async def current(self, owner: str, session_id: str) -> StreamingSession:
        return await self.registry.current(owner, session_id)

    async def reopen(self, owner: str, session_id: str) -> StreamingSession:
        return await self.registry.reopen(owner, session_id)

    async def attach_connection(self, owner: str, session_id: str) -> StreamingSession:
        """``attach`` for a websocket connection, refused while the server drains: it
        would be closed (1012) before its next chunk."""
        self.refuse_if_draining()
        return await self.attach(owner, session_id)

    async def attach(self, owner: str, session_id: str) -> StreamingSession:
        """An open session as the store has it now, for a connection to drive."""
        session = await self.registry.current(owner, session_id)
        if session.closed:
            raise errors.session_closed(session.id, session.close_reason)
        return session

    async def list_sessions(self, owner: str) -> list[SessionObject]:
        return await self.registry.list_sessions(owner)

    async def stored_context(
        self, owner: str, session_id: str, num_chunks: int, num_tokens: int
    ) -> tuple[list[int] | None, chat.ChatState | None]:
        """``owner``'s session as it was after its first ``num_chunks`` chunks: its token ids
        and its conversation, as the store keeps them; where the store keeps no
        transcripts, the first ``num_tokens`` of the session in memory, if it is held.
        None for what neither has."""
        record = await self.store.get(session_id)
        prefix = await self.store.transcript_at(session_id, num_chunks)
        conversation = None if record is None else chat.ChatState.load(record.chat)
        if prefix is None:
            try:
                session = await self.registry.get(owner, session_id, include_closed=True)
            except APIError:
                return None, conversation
            prefix, conversation = session.token_ids[:num_tokens], session.chat
        return prefix, conversation

    async def close_least_recent_idle(self, prefix: str) -> bool:
        """Close the least recently used idle session whose id starts with ``prefix``, to
        make room (a Responses chain, continued later by a fork from the store); False
        if there is none."""
        idle = [
            s for s in self.registry.held.values() if s.id.startswith(prefix) and not s.lock.locked() and not s.closed
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda s: s.last_activity)
        await self.close(oldest.owner, oldest.id, reason="evicted")
        return True

    def refuse_if_draining(self) -> None:
        """New work (a session, a chunk, a connection) is refused while the server drains."""
        if self.draining:
            raise errors.server_draining()

    def check_model(self, model: str | None) -> None:
        """A request that names a model names the one served (vLLM's routes answer the same 404)."""
        if model is not None and model != self.model_name:
            raise errors.model_not_found(model)

    def describe(self, session: StreamingSession) -> SessionObject:
        return self.registry.describe(session)

    async def update_defaults(self, owner: str, session_id: str, defaults: SessionDefaults) -> StreamingSession:
        session = await self.registry.open_session(owner, session_id)
        inputs.check_sampling(defaults, "session", self.max_chunk_output_tokens, self.vocab_size)
        merged = session.defaults.model_dump(exclude_none=True) | defaults.model_dump(exclude_none=True)
        now = time.time()
        async with self.registry.store_errors():
            await self.store.update(session.id, defaults=merged, last_activity=now)
        session.defaults = SessionDefaults(**merged)
        session.last_activity = now
        return session

    async def update_metadata(self, owner: str, session_id: str, metadata: dict[str, str]) -> StreamingSession:
        session = await self.registry.open_session(owner, session_id)
        async with self.registry.store_errors():
            await self.store.update(session.id, metadata=metadata)
        session.metadata = dict(metadata)
        return session

    async def transcript(self, owner: str, session_id: str) -> tuple[StreamingSession, str]:
        session = await self.registry.current(owner, session_id)
        return session, self.tokenizer.decode(session.token_ids)

    async def park(self, owner: str, session_id: str) -> StreamingSession:
        """Park one session now (a client's, an operator's or a test's call), and
        return once the CPU tier holds its whole context (see tier_barrier)."""
        session = await self.registry.get(owner, session_id)
        if await self.parking.park([session], "requested"):
            await self.parking.tier_barrier()
        return session

    async def tier_barrier(self) -> None:
        await self.parking.tier_barrier()

    # ------------------------------------------------------------------ chunks
    async def start_chunk(
        self,
        owner: str,
        session_id: str,
        chunk_input: inputs.ChunkInput,
        options: SamplingOptions,
        *,
        transport: str,
        wait: bool,
        charged: bool = False,
        generate: bool = True,
    ) -> ChunkRun:
        """Check a chunk, take its session's lock and lease, admit it onto the device
        and start it. Every refusal comes from here, before a response has begun.
        ``wait=False`` (REST) refuses a second chunk in flight with 409; ``wait=True``
        (websockets) queues behind it, in order. ``charged``: the request's tokens were
        charged to its key already (an OpenAI route's body, by OpenAIRequestMiddleware).
        ``generate`` False: a warm-up, computed with no answer (inputs.Turn)."""
        with (
            self._counted(),
            tracer.start_as_current_span(
                "streamsess.chunk.admission", attributes={"streamsess.session_id": session_id}
            ),
        ):
            self.refuse_if_draining()
            session = await self.registry.open_session(owner, session_id)
            turn = self._plan(session, chunk_input, generate)
            params = self._chunk_params(session, options, turn)
            defaults = session.defaults  # replaced, never changed in place, by an update
            self._check_chunk(session, turn, params)
            if not charged:
                await self.limits.charge_tokens(owner, len(turn.input_ids) + (params.max_tokens or 0))
            if not wait and session.answering:
                raise errors.chunk_in_flight()
            await session.lock.acquire()
            renewal: asyncio.Task[None] | None = None
            try:
                # Re-check after waiting: the session may have closed or grown meanwhile,
                # or the server begun to drain.
                self.refuse_if_draining()
                if session.closed:
                    raise errors.session_closed(session.id, session.close_reason)
                # Renewed from now on: waiting for room on the device can outlast a lease.
                renewal = await self.registry.hold_lease(session)
                replanned = inputs.depends_on_context(chunk_input)
                if replanned:
                    # A chat turn closes the reply it follows: the one of the chunk waited for.
                    turn = self._plan(session, chunk_input, generate)
                if replanned or session.defaults is not defaults:  # or updated while it waited
                    params = self._chunk_params(session, options, turn)
                self._check_chunk(session, turn, params)
                context = len(session.token_ids) if turn.start is None else turn.start
                await self.parking.admit(session, context + len(turn.input_ids) + (params.max_tokens or 0))
            except BaseException:
                if renewal is not None:
                    renewal.cancel()
                    await self.registry.release_lease(session)
                session.lock.release()
                raise
        # From here on the run owns the lock, the lease and the reservation.
        run = ChunkRun(
            session,
            lambda run: self._chunk_events(run, turn, params, transport),
            lambda run: self._release_chunk(run, renewal),
        )
        self._runs.add(run)
        self._undelivered.add(run)
        run.delivered.add_done_callback(lambda _: self._undelivered.discard(run))
        return run

    def sampling_params(self, session: StreamingSession, options: SamplingOptions) -> Any:
        return inputs.sampling_params(
            session.defaults, options, self.max_chunk_output_tokens, self.vocab_size, self._model_sampling
        )

    def _plan(self, session: StreamingSession, chunk_input: inputs.ChunkInput, generate: bool) -> inputs.Turn:
        return inputs.plan(self.tokenizer, self.vocab_size, chunk_input, session.token_ids, session.chat, generate)

    def _chunk_params(self, session: StreamingSession, options: SamplingOptions, turn: inputs.Turn) -> Any:
        params = self.sampling_params(session, options)
        params.structured_outputs = turn.structured_outputs
        if not turn.generate:
            params.max_tokens = 1  # a warm-up: the engine samples one token, which is dropped
        return params

    def _check_chunk(self, session: StreamingSession, turn: inputs.Turn, params: Any) -> None:
        context = len(session.token_ids) if turn.start is None else turn.start
        inputs.check_chunk(
            context, session.max_tokens, turn.input_ids, params, self._settings.max_chunk_tokens, turn.replayed
        )

    async def _chunk_events(
        self, run: ChunkRun, turn: inputs.Turn, params: Any, transport: str
    ) -> AsyncIterator[ChunkEvent]:
        """The chunk's events, run in its ChunkRun's task: the result is committed to
        the store before it is yielded."""
        session = run.session
        context_before = len(session.token_ids)
        cut = turn.start is not None and turn.start != context_before
        transcript_before = list(session.token_ids) if cut else None  # what an undone cut restores
        with self._counted(), tracer.start_as_current_span("streamsess.chunk") as span:
            if span.is_recording():  # attributes only when tracing: every chunk passes here
                span.set_attributes(
                    {
                        "streamsess.session_id": session.id,
                        "streamsess.transport": transport,
                        "streamsess.context_tokens": context_before,
                        "streamsess.input_tokens": len(turn.input_ids),
                    }
                )
            try:
                async for event in session.generate(
                    turn.input_ids, params, run.stop_requested, start=turn.start if cut else None, answer=turn.generate
                ):
                    if isinstance(event, ChunkResult):
                        chunk_span_attributes(span, event)
                        chat_before = session.chat
                        session.chat = turn.conversation_after(event.text)
                        try:
                            with tracer.start_as_current_span("streamsess.chunk.commit"):
                                await self.registry.commit(session, event, context_before, transcript_before)
                        except BaseException:
                            session.chat = chat_before  # the chunk is undone
                            raise
                        run.committed = True
                        self._metrics.observe_chunk(event, transport)
                        if run.after_commit is not None:
                            await run.after_commit(event)  # by the chunk's owner, not its consumer
                    yield event
            except ChunkRefusedError as exc:
                raise errors.chunk_refused(exc) from exc
            except SessionFailedError as exc:
                if session.close_reason == ENGINE_ERROR:
                    await self._close(session, ENGINE_ERROR)
                    raise errors.session_failed(exc) from exc
                # Closed by someone else (DELETE, shutdown) while answering.
                raise errors.closed_while_answering(session.close_reason) from exc

    def _release_chunk(self, run: ChunkRun, renewal: asyncio.Task[None] | None) -> Awaitable[None] | None:
        """Everything a chunk held, released once, when its task has ended however it
        did. Returns the store's part to await when there is one: an uncommitted chunk's
        lease is released before the lock (else a stale release could drop the lease of
        the session's next chunk), and a session closed meanwhile is closed in the store."""
        self._runs.discard(run)
        if renewal is not None:
            renewal.cancel()
        release_lease = renewal is not None and not run.committed
        if release_lease or run.session.closed:
            return self._release_after_store(run.session, release_lease)
        self._unlock(run.session)
        return None

    async def _release_after_store(self, session: StreamingSession, release_lease: bool) -> None:
        try:
            if release_lease:
                await self.registry.release_lease(session)
        finally:
            self._unlock(session)
            if session.closed:
                await self.registry.persist_close(session)

    def _unlock(self, session: StreamingSession) -> None:
        if not session.has_engine_request:
            session.device_tokens = 0  # admitted, but failed before it ran (or undone)
        session.lock.release()
        self.parking.capacity_freed.set()
        if session.closed:
            self.registry.forget(session)

    # ------------------------------------------------------------------ closing
    async def close(self, owner: str, session_id: str, reason: str = errors.DELETED) -> StreamingSession:
        session = await self.registry.get(owner, session_id)
        # The store first: if it is down, the session stays open everywhere.
        async with self.registry.store_errors():
            await self.store.update(session.id, status="closed", close_reason=reason, last_activity=time.time())
        await self._close(session, reason, persist=False)
        return session

    async def _close(self, session: StreamingSession, reason: str, persist: bool = True) -> None:
        await session.close(reason)
        if persist:
            await self.registry.persist_close(session)
        if not session.lock.locked():
            self.registry.forget(session)


def chunk_span_attributes(span: trace.Span, result: ChunkResult) -> None:
    """A chunk's outcome on its span: where its prompt's KV came from, and its resume."""
    if not span.is_recording():
        return
    details = result.usage.prompt_tokens_details
    span.set_attributes(
        {
            f"streamsess.prompt_tokens.{source}": getattr(details, f"{source}_tokens")
            for source in ("device", "cpu_tier", "disk_tier", "computed")
        }
    )
    if result.resumed_from is not None:
        span.set_attribute("streamsess.resumed_from", result.resumed_from)
    if result.time_to_first_token is not None:
        span.set_attribute("streamsess.time_to_first_token_s", result.time_to_first_token)
