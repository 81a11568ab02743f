"""One streaming-input session: its transcript, and the vLLM request that serves it.

The transcript (``token_ids``: every chunk's input and every token the client received)
is the session; an engine request is a cache of it. While *active*, the session feeds one
``AsyncLLM.generate`` from a queue of ``StreamingInput`` chunks, so the engine keeps its KV
on the device between chunks and answers each without recomputing what came before. A
background task ("the pump") owns that request; cancelling it aborts it and frees its KV.

A *parked* session has no engine request: ``park`` ends it gracefully, so the connector
stores the whole context in the CPU tier (connectors/offloading.py, the session tail
store). Its next chunk starts a new request whose first input is the transcript plus the
chunk; the prefix comes from the device prefix cache or the CPU tier (its usage says which).
No FastAPI here: transports drive sessions through the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from opentelemetry import propagate
from vllm.engine.protocol import StreamingInput
from vllm.inputs.engine import tokens_input

from app.protocol import SessionDefaults, SessionStatus
from app.provenance import PrefillSources, ProvenanceRecorder, chunk_usage, resume_source
from app.sessions.admission import DeviceTokens
from app.sessions.chat import ChatState
from app.sessions.chunk import CANCELLED, ENGINE_ERROR, ChunkDelta, ChunkResult
from app.sessions.errors import ChunkRefusedError, SessionFailedError, is_input_error
from app.store import SessionRecord
from connectors.streaming_stats import register_chunk_trace

logger = logging.getLogger(__name__)

# How long a graceful close waits for the engine to finish the request before aborting.
GRACEFUL_CLOSE_S = 10.0


def current_trace_headers() -> dict[str, str]:
    """The current span's context as W3C headers (none unless tracing)."""
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


class StreamingSession:
    device_tokens = DeviceTokens()  # what its engine request holds on the device (the admission estimate)

    def __init__(
        self,
        session_id: str,
        owner: str,
        model: str,
        engine: Any,
        defaults: SessionDefaults,
        metadata: dict[str, str],
        max_tokens: int,
        recorder: ProvenanceRecorder | None = None,
        cache_salt: str | None = None,
        device_holders: set[StreamingSession] | None = None,
    ):
        self.id = session_id
        self.owner = owner
        self.model = model
        self.defaults = defaults
        self.metadata = metadata
        self.max_tokens = max_tokens
        # The owner's prefix-cache namespace (see app/cache_salt.py).
        self.cache_salt = cache_salt
        self.created = int(time.time())
        self.last_activity = time.time()
        self.status: SessionStatus = "active"
        self.close_reason: str | None = None
        # The registry's sessions on the device, which device_tokens keeps this one in or out of.
        self.device_holders: set[StreamingSession] = set() if device_holders is None else device_holders
        # The session's context: every chunk's input and every token of its output,
        # as the client received them.
        self.token_ids: list[int] = []
        # The tail of token_ids the live engine request lacks: vLLM's streaming input
        # discards a chunk's last sampled token when the next chunk arrives (it has no
        # KV yet), so the next chunk sends it again at its head (one token of prefill).
        self._unsent: list[int] = []
        self.num_chunks = 0
        # The conversation the context renders, for a chat (None: not a chat's context).
        self.chat: ChatState | None = ChatState()
        # One chunk in flight: REST callers fail fast on it, websocket callers queue.
        self.lock = asyncio.Lock()
        self._engine = engine
        self._recorder = recorder
        self._inputs: asyncio.Queue[StreamingInput | None] = asyncio.Queue()
        self._outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Task[None]] = set()  # undone chunks' requests, unwinding
        self._num_tokens_at_close: int | None = None
        # Set when a chunk was undone, until the next one starts: its lock may be
        # held a moment longer while it unwinds, but it is no longer answering.
        self._undone = False
        # True while the service parks this session (it holds the lock meanwhile).
        self.parking = False

    @classmethod
    def from_record(
        cls,
        record: SessionRecord,
        transcript: list[int],
        engine: Any,
        max_tokens: int,
        recorder: ProvenanceRecorder | None = None,
        cache_salt: str | None = None,
        device_holders: set[StreamingSession] | None = None,
    ) -> StreamingSession:
        """A session as the store keeps it: parked (no engine request), or closed."""
        session = cls(
            session_id=record.id,
            owner=record.owner,
            model=record.model,
            engine=engine,
            defaults=SessionDefaults(**record.defaults),
            metadata=dict(record.metadata),
            max_tokens=max_tokens,
            recorder=recorder,
            cache_salt=cache_salt,
            device_holders=device_holders,
        )
        session.created = int(record.created)
        session.last_activity = record.last_activity
        session.token_ids = list(transcript)
        session.chat = ChatState.load(record.chat)
        session.num_chunks = record.num_chunks
        session.status = "closed" if record.status == "closed" else "parked"
        session.close_reason = record.close_reason
        if session.closed and not transcript:
            session._num_tokens_at_close = record.num_tokens  # remembered without its transcript
        return session

    def record(self) -> SessionRecord:
        return SessionRecord(
            id=self.id,
            owner=self.owner,
            model=self.model,
            defaults=self.defaults.model_dump(exclude_none=True),
            metadata=dict(self.metadata),
            status="closed" if self.closed else "active",
            close_reason=self.close_reason,
            num_chunks=self.num_chunks,
            num_tokens=self.num_tokens,
            created=float(self.created),
            last_activity=self.last_activity,
            chat=None if self.chat is None else self.chat.dump(),
        )

    @property
    def closed(self) -> bool:
        return self.status == "closed"

    @property
    def answering(self) -> bool:
        """A chunk holds the lock and is answering: not a park, nor an undone chunk
        unwinding (a chunk sent meanwhile waits the few milliseconds those take)."""
        return self.lock.locked() and not self.parking and not self._undone

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self._num_tokens_at_close is None else self._num_tokens_at_close

    def forget_transcript(self) -> None:
        """Drop a closed session's transcript from memory, keeping its length (the
        store, if any, keeps the tokens until closed_session_retention_s)."""
        if self.closed and self._num_tokens_at_close is None:
            self._num_tokens_at_close = len(self.token_ids)
            self.token_ids = []

    @property
    def has_engine_request(self) -> bool:
        return self._pump is not None and not self._pump.done()

    @property
    def idle(self) -> bool:
        """Open, holding an engine request, answering nothing: parkable."""
        return self.has_engine_request and self.status == "active" and not self.lock.locked()

    @property
    def request_id(self) -> str:
        return self.id

    # ------------------------------------------------------------------ chunks
    async def generate(
        self,
        input_ids: list[int],
        params: Any,
        stop: asyncio.Event | None = None,
        start: int | None = None,
        answer: bool = True,
    ) -> AsyncGenerator[ChunkDelta | ChunkResult, None]:
        """Append one chunk and stream its answer (deltas, then one ``ChunkResult``); the
        caller holds ``self.lock``. A consumer that stops early (a client disconnect)
        undoes the chunk: the request is aborted and the session, parked, holds the
        transcript from before it (as the store does), so it can be sent again. ``stop``
        ends the answer at the next token, keeping it (finish reason ``cancelled``).
        ``start`` cuts the context to its first ``start`` tokens first (the request ends,
        its KV kept in the CPU tier, and a new one resumes from the prefix). Without
        ``answer`` (a warm-up) the chunk answers nothing: vLLM drops the one token it
        samples after it (no KV) when the next chunk comes, so it is kept nowhere."""
        if self.closed:
            raise SessionFailedError(f"session {self.id} is closed ({self.close_reason})")
        await self._settle_abandoned()
        self._undone = False
        index = self.num_chunks
        # What an undone chunk restores: nothing is appended to this list before the
        # chunk ends, and a cut replaces it with a new one.
        transcript_before = self.token_ids
        if start is not None:
            if not await self.park():
                self._drop_request(self.token_ids, self.num_chunks)
                await self._settle_abandoned()
            self.token_ids = self.token_ids[:start]
        context_before = len(self.token_ids)
        started = time.monotonic()
        self.status = "generating"
        new_request = self._pump is None or self._pump.done()  # none, or it ended while idle
        resumed = new_request and context_before > 0  # the first chunk after a park
        if new_request:
            self._new_request(input_ids, params)
        else:
            register_chunk_trace(self.request_id, current_trace_headers())
            prompt = tokens_input(self._unsent + list(input_ids))
            self._inputs.put_nowait(StreamingInput(prompt=prompt, sampling_params=params))

        token_ids: list[int] = []
        text_parts: list[str] = []
        first_token_at: float | None = None
        finish_reason: str | None = None
        num_cached_tokens = 0
        finished_cleanly = restarted = False
        try:
            while finish_reason is None:
                item = await self._outputs.get()
                if isinstance(item, BaseException):
                    if not token_ids and is_input_error(item):
                        raise ChunkRefusedError(str(item)) from item
                    raise SessionFailedError(f"engine request failed: {item}") from item
                if item is None:
                    if token_ids or restarted or self.closed:
                        raise SessionFailedError("the engine ended the session mid-chunk")
                    # Ended before this chunk began (seen in CI after websocket hang-ups, cause
                    # not found yet): the chunk goes on a new request from the transcript, once.
                    logger.warning(
                        "session %s: its engine request ended before chunk %d began; sent again on a new request",
                        self.id,
                        index,
                    )
                    restarted = new_request = True
                    resumed = context_before > 0
                    self._new_request(input_ids, params)
                    continue
                completion = item.outputs[0]
                num_cached_tokens = item.num_cached_tokens or num_cached_tokens
                if completion.token_ids and answer:
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                    token_ids.extend(completion.token_ids)
                    text_parts.append(completion.text)
                    yield ChunkDelta(list(completion.token_ids), completion.text)
                finish_reason = completion.finish_reason
                if finish_reason is None and stop is not None and stop.is_set():
                    finish_reason = CANCELLED
            finished_cleanly = True
        except SessionFailedError:
            self.terminate(ENGINE_ERROR)  # keeps the reason if it was closed meanwhile
            raise
        finally:
            if not finished_cleanly and not self.closed:
                # The consumer stopped early (a client disconnect cancels it): a
                # request cannot resume from the middle of a chunk, so undo it.
                self._abandon(transcript_before, index)

        recorded = self._recorder.pop(self.request_id) if self._recorder else None
        if recorded is not None and self._recorder is not None:
            recorded = await self._recorder.split_disk_tier(recorded)
        if new_request:
            # An ordinary prefill: its hits come from the device prefix cache or the
            # CPU tier, as the scheduler measured them.
            sources = recorded or PrefillSources(device_tokens=num_cached_tokens, cpu_tier_tokens=0)
        else:
            # A chunk of a live request attends over the session's context on device
            # (but the token sent again, which it computes with the chunk).
            sources = PrefillSources(device_tokens=context_before - len(self._unsent), cpu_tier_tokens=0)
        usage = chunk_usage(context_before + len(input_ids), len(token_ids), sources)
        if finish_reason == CANCELLED:
            # The request ends here; the next chunk resumes from every token so far.
            await self.restart_from(self.token_ids + list(input_ids) + token_ids, self.num_chunks + 1)
        else:
            self.token_ids += list(input_ids) + token_ids
            self._unsent = token_ids[-1:]
            self.num_chunks += 1
            self.status = "active"
            # The request holds the whole context (its last token without KV yet).
            self.device_tokens = len(self.token_ids)
        self.last_activity = time.time()
        yield ChunkResult(
            index=index,
            token_ids=token_ids,
            text="".join(text_parts),
            finish_reason=finish_reason,
            usage=usage,
            time_to_first_token=None if first_token_at is None else first_token_at - started,
            resumed_from=resume_source(sources) if resumed else None,
            start=start,
        )

    # ------------------------------------------------------------------ engine
    def _new_request(self, input_ids: list[int], params: Any) -> None:
        """A new engine request, with queues of its own (so an aborted one that ends late
        cannot end the next one's chunk): its first input is the whole transcript plus
        the chunk (exact token ids, never re-tokenized text)."""
        self._unsent = []
        self._inputs, self._outputs = asyncio.Queue(), asyncio.Queue()
        prompt = tokens_input(list(self.token_ids) + list(input_ids), cache_salt=self.cache_salt)
        self._inputs.put_nowait(StreamingInput(prompt=prompt, sampling_params=params))
        # The engine request's trace context: this chunk's span. vLLM carries one context
        # a request; each later chunk's own goes to connectors.streaming_stats, which
        # makes vLLM's engine span (``llm_request``) of every chunk.
        trace_headers = current_trace_headers()
        register_chunk_trace(self.request_id, trace_headers)
        self._pump = asyncio.create_task(
            self._run_engine(params, self._inputs, self._outputs, trace_headers), name=f"session-{self.id}"
        )

    @staticmethod
    async def _feed(inputs: asyncio.Queue[StreamingInput | None]) -> AsyncIterator[StreamingInput]:
        while (chunk := await inputs.get()) is not None:
            yield chunk

    async def _run_engine(
        self,
        first_params: Any,
        inputs: asyncio.Queue[StreamingInput | None],
        outputs: asyncio.Queue[Any],
        trace_headers: dict[str, str],
    ) -> None:
        try:
            traced = {"trace_headers": trace_headers} if trace_headers else {}  # only when tracing
            async for output in self._engine.generate(
                prompt=self._feed(inputs),
                sampling_params=first_params,
                request_id=self.request_id,
                **traced,
            ):
                outputs.put_nowait(output)
            outputs.put_nowait(None)
        except asyncio.CancelledError:
            # Closed or aborted: wake a chunk that may be waiting for output.
            outputs.put_nowait(None)
            raise
        except BaseException as exc:  # engine errors reach the chunk's consumer
            logger.warning("session %s: engine request failed: %s", self.id, exc)
            outputs.put_nowait(exc)
        finally:
            self.device_tokens = 0
            if self._pump is None or self._pump is asyncio.current_task():
                register_chunk_trace(self.request_id, None)

    # ------------------------------------------------------------------ parking
    async def park(self) -> bool:
        """End the engine request gracefully, keeping the transcript; the caller
        holds ``self.lock``. An idle request that ends this way is stored whole in
        the CPU tier by our connector. Returns False, and changes nothing, unless
        the session was idle with a live request."""
        pump = self._pump
        if pump is None or pump.done() or self.status != "active":
            return False
        self._inputs.put_nowait(None)
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(pump), GRACEFUL_CLOSE_S)
        if not pump.done():
            pump.cancel()  # the engine did not end it in time: abort
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        self._pump = None
        self.status = "parked"
        return True

    def _abandon(self, transcript: list[int], index: int) -> None:
        """Undo the chunk in flight without waiting (this runs while the chunk's
        consumer is being cancelled): the session, parked, holds the transcript
        from before it."""
        self._drop_request(transcript, index)
        self._undone = True

    def _drop_request(self, token_ids: list[int], num_chunks: int) -> None:
        """Abort the engine request without waiting for it and hold ``token_ids`` as the transcript,
        parked. The next request (the same id) first waits for it to end (``_settle_abandoned``)."""
        pump, self._pump = self._pump, None
        if pump is not None and not pump.done():
            pump.cancel()
            self._abandoned.add(pump)
        self.device_tokens = 0
        self.token_ids = list(token_ids)
        self.num_chunks = num_chunks
        if not self.closed:
            self.status = "parked"

    async def _settle_abandoned(self) -> None:
        """Wait until every aborted request has ended (tracked until then, whoever waits)."""
        while self._abandoned:
            await asyncio.wait(set(self._abandoned))
            self._abandoned = {pump for pump in self._abandoned if not pump.done()}

    async def restart_from(self, token_ids: list[int], num_chunks: int) -> None:
        """Drop the engine request (aborting it) and hold ``token_ids`` as the
        transcript, parked: the next chunk resumes from it. For a chunk the store
        did not take (it is undone), and for a session another replica extended."""
        self._drop_request(token_ids, num_chunks)
        await self._settle_abandoned()

    # ------------------------------------------------------------------ closing
    def terminate(self, reason: str) -> None:
        """Close now: cancelling the pump aborts the engine request and frees its KV.
        A session closed already keeps its first close reason."""
        if not self.closed:
            self.status = "closed"
            self.close_reason = reason
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()

    async def close(self, reason: str) -> None:
        """Close gracefully when idle (the engine finishes the request), else abort."""
        if self.closed:
            return
        pump = self._pump
        if self.status == "generating" or pump is None:
            self.terminate(reason)
        else:
            self.status = "closed"
            self.close_reason = reason
            self._inputs.put_nowait(None)
        if pump is not None:
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(pump), GRACEFUL_CLOSE_S)
            if not pump.done():
                pump.cancel()
