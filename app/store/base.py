"""The session store's interface, its record, and the store that keeps nothing.

A session's durable state is one ``SessionRecord`` (its row) plus its transcript,
kept as one token-id run per chunk, appended as chunks complete. A *lease* says
which replica may extend a session: at most one chunk is in flight per session
across every replica sharing a database, and a lease that its holder stopped
renewing (a lost replica) expires, so another replica can go on.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any


class StoreUnavailableError(RuntimeError):
    """The store could not be read or written (database down, disk full). Nothing
    was half-written: each operation is one transaction."""


class SessionExistsError(ValueError):
    """A session with this id is in the store already."""


class LeaseRefused(enum.Enum):
    """Why a chunk lease was not granted."""

    NOT_FOUND = "not_found"
    CLOSED = "closed"
    HELD = "held"  # another replica is answering a chunk of this session


@dataclass
class SessionRecord:
    """A session's row: everything but the transcript."""

    id: str
    owner: str
    model: str
    defaults: dict[str, Any]
    metadata: dict[str, str]
    status: str  # active | parked | closed (generating is never stored)
    close_reason: str | None
    num_chunks: int
    num_tokens: int
    created: float
    last_activity: float
    # A chat session's conversation (instructions, messages), JSON-able; None where
    # its context is not a chat's (raw text or token ids went in).
    chat: dict[str, Any] | None = None


@dataclass
class StoredObject:
    """An object of OpenAI's stateful APIs (a stored response, a conversation item),
    kept with the session that holds its context and gone when that session is purged."""

    id: str
    kind: str  # "response" | "item"
    owner: str
    session_id: str
    seq: int  # order among the session's objects of this kind
    created: float
    data: dict[str, Any]


class SessionStore(abc.ABC):
    """Every method is one transaction; failures raise ``StoreUnavailableError``."""

    durable: bool = True
    shared = False  # other replicas can reach it (a database server, not a local file)

    async def start(self) -> None:  # noqa: B027 (optional: a store may need no connection)
        """Connect and bring the schema to the newest version."""

    async def close(self) -> None:  # noqa: B027
        """Release connections."""

    async def ping(self) -> None:  # noqa: B027 (a store with no connection is always reachable)
        """Raise ``StoreUnavailableError`` if the store cannot be reached now (readiness)."""

    # Replicas sharing the store (app/store/cluster.py). A store of one server (none, memory)
    # has no other replica: everyone joins, and a proposed value is the value.
    async def join(self, replica_id: str, instance: str, ttl_s: float) -> float | None:
        """Hold ``replica_id`` for ``instance``; refused (the other holder's heartbeat
        age, in seconds) while another instance holds it and beat within ``ttl_s``."""
        return None

    async def heartbeat(self, replica_id: str, instance: str) -> bool:
        """Still holding ``replica_id`` (False: another instance took it over)."""
        return True

    async def leave(self, replica_id: str, instance: str) -> None:  # noqa: B027
        """Give ``replica_id`` up (a stop)."""

    async def shared_value(self, name: str, proposed: str) -> str:
        """The cluster's value of ``name``: ``proposed`` if it is the first to ask."""
        return proposed

    @abc.abstractmethod
    async def create(self, record: SessionRecord) -> None:
        """Insert a new session; ``SessionExistsError`` if the id is taken."""

    @abc.abstractmethod
    async def load(self, session_id: str) -> tuple[SessionRecord, list[int]] | None:
        """The session and its transcript, or None."""

    @abc.abstractmethod
    async def get(self, session_id: str) -> SessionRecord | None:
        """The session's row alone."""

    @abc.abstractmethod
    async def list_open(self, owner: str) -> list[SessionRecord]:
        """The owner's sessions that are not closed, oldest first."""

    @abc.abstractmethod
    async def update(self, session_id: str, **fields: Any) -> None:
        """Set ``defaults``, ``status``, ``close_reason`` or ``last_activity``."""

    @abc.abstractmethod
    async def acquire_lease(self, session_id: str, holder: str, ttl_s: float) -> SessionRecord | LeaseRefused:
        """Take the session's chunk lease for ``holder`` (re-entrant for the same
        holder; an expired lease of another holder is taken over)."""

    @abc.abstractmethod
    async def renew_lease(self, session_id: str, holder: str, ttl_s: float) -> bool:
        """Extend a held lease; False if ``holder`` no longer holds it."""

    @abc.abstractmethod
    async def release_lease(self, session_id: str, holder: str) -> None:
        """Give the lease up without a chunk (a failed or refused chunk)."""

    @abc.abstractmethod
    async def commit_chunk(
        self,
        session_id: str,
        holder: str,
        index: int,
        token_ids: list[int],
        last_activity: float,
        start: int | None = None,
        chat: dict[str, Any] | None = None,
    ) -> bool:
        """Append chunk ``index``'s tokens to the transcript (cut to its first ``start``
        tokens first, if given), set the session's ``chat`` state, and release the lease,
        in one transaction; False (and nothing written) if ``holder`` lost the lease or
        the session already has a chunk ``index``."""

    @abc.abstractmethod
    async def expire(self, idle_before: float, purge_closed_before: float) -> int:
        """Close open sessions idle since before ``idle_before`` and delete sessions
        closed before ``purge_closed_before`` (their objects too); returns how many were closed."""

    @abc.abstractmethod
    async def transcript_at(self, session_id: str, num_chunks: int) -> list[int] | None:
        """The session's context as it was after its first ``num_chunks`` chunks (cuts
        replayed); None where the store does not keep transcripts."""

    # ------------------------------------------------------------------ objects
    @abc.abstractmethod
    async def put_objects(self, objects: list[StoredObject]) -> None:
        """Insert or replace each object (by its id), all or none: a response and the
        items it adds to its conversation are written together."""

    @abc.abstractmethod
    async def get_object(self, kind: str, object_id: str) -> StoredObject | None: ...

    @abc.abstractmethod
    async def list_objects(self, kind: str, session_id: str) -> list[StoredObject]:
        """The session's objects of ``kind``, in ``seq`` order."""

    @abc.abstractmethod
    async def delete_object(self, kind: str, object_id: str) -> bool: ...

    def forget_session(self, session_id: str) -> None:  # noqa: B027 (a durable store keeps them)
        """The server dropped a closed session from memory."""


class NullStore(SessionStore):
    """Keeps nothing: sessions live in the server's memory only (``store_url=none``).
    Not durable, so the service takes no leases: its own lock orders chunks. The
    stateful APIs' objects are kept in memory, and dropped with their sessions'
    expiry (a session closed here is gone)."""

    durable = False

    def __init__(self) -> None:
        self._objects: dict[str, StoredObject] = {}

    async def create(self, record: SessionRecord) -> None:
        return None

    async def load(self, session_id: str) -> tuple[SessionRecord, list[int]] | None:
        return None

    async def get(self, session_id: str) -> SessionRecord | None:
        return None

    async def list_open(self, owner: str) -> list[SessionRecord]:
        return []

    async def update(self, session_id: str, **fields: Any) -> None:
        return None

    async def acquire_lease(self, session_id: str, holder: str, ttl_s: float) -> SessionRecord | LeaseRefused:
        return LeaseRefused.NOT_FOUND

    async def renew_lease(self, session_id: str, holder: str, ttl_s: float) -> bool:
        return True

    async def release_lease(self, session_id: str, holder: str) -> None:
        return None

    async def commit_chunk(
        self,
        session_id: str,
        holder: str,
        index: int,
        token_ids: list[int],
        last_activity: float,
        start: int | None = None,
        chat: dict[str, Any] | None = None,
    ) -> bool:
        return True

    async def expire(self, idle_before: float, purge_closed_before: float) -> int:
        return 0

    async def transcript_at(self, session_id: str, num_chunks: int) -> list[int] | None:
        return None

    async def put_objects(self, objects: list[StoredObject]) -> None:
        self._objects.update((obj.id, obj) for obj in objects)

    async def get_object(self, kind: str, object_id: str) -> StoredObject | None:
        obj = self._objects.get(object_id)
        return obj if obj is not None and obj.kind == kind else None

    async def list_objects(self, kind: str, session_id: str) -> list[StoredObject]:
        found = [o for o in self._objects.values() if o.kind == kind and o.session_id == session_id]
        return sorted(found, key=lambda o: o.seq)

    async def delete_object(self, kind: str, object_id: str) -> bool:
        if await self.get_object(kind, object_id) is None:
            return False
        del self._objects[object_id]
        return True

    def forget_session(self, session_id: str) -> None:
        """A session gone from memory takes its objects with it."""
        for object_id in [o.id for o in self._objects.values() if o.session_id == session_id]:
            del self._objects[object_id]
