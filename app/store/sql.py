"""The session store on SQL: SQLite (the default) or PostgreSQL, through SQLAlchemy.

One code path for both (SQLAlchemy Core over aiosqlite or asyncpg); the schema is
Alembic's (``migrations/``), brought to its newest version at start, under an
advisory lock on PostgreSQL so replicas starting together do not race.

Errors never carry statement parameters (``hide_parameters``): a failure logged
at the default level holds no session metadata. Durability: SQLite runs in WAL mode with ``synchronous=FULL``, so a committed chunk
survives a killed process and a power loss; PostgreSQL commits as it is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from array import array
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from app.metrics import session_metrics
from app.store.base import (
    LeaseRefused,
    SessionExistsError,
    SessionRecord,
    SessionStore,
    StoredObject,
    StoreUnavailableError,
)

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: the key of the PostgreSQL advisory lock held while migrating.
MIGRATION_LOCK_KEY = 0x5E55_1045
# How long a statement may take before the store counts as unavailable.
STATEMENT_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0

metadata = sa.MetaData()
sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("defaults", sa.Text, nullable=False),
    sa.Column("metadata", sa.Text, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("close_reason", sa.String(64)),
    sa.Column("num_chunks", sa.Integer, nullable=False),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("last_activity", sa.Float, nullable=False),
    sa.Column("lease_holder", sa.String(256)),
    sa.Column("lease_expires", sa.Float),
    sa.Column("chat", sa.Text),  # JSON: a chat session's conversation; NULL: not a chat's context
)
session_chunks = sa.Table(
    "session_chunks",
    metadata,
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("idx", sa.Integer, primary_key=True),
    sa.Column("token_ids", sa.LargeBinary, nullable=False),
    sa.Column("start", sa.Integer),  # where in the transcript the chunk begins; NULL: at its end
)
api_objects = sa.Table(
    "api_objects",
    metadata,
    sa.Column("id", sa.String(128), primary_key=True),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("session_id", sa.String(128), sa.ForeignKey("sessions.id", ondelete="CASCADE"), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
)
replicas = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.String(256), primary_key=True),
    sa.Column("instance", sa.String(64), nullable=False),
    sa.Column("heartbeat", sa.Float, nullable=False),
)
cluster = sa.Table(
    "cluster",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)
RECORD_COLUMNS = [c for c in sessions.c if not c.name.startswith("lease_")]


def pack_tokens(token_ids: list[int]) -> bytes:
    """Little-endian int32, whatever the host's byte order."""
    packed = array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def async_url(url: str) -> str:
    """SQLAlchemy's async driver for a plain database URL."""
    for plain, driver in (
        ("sqlite://", "sqlite+aiosqlite://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
    ):
        if url.startswith(plain):
            return driver + url[len(plain) :]
    return url


def _record(row: Any) -> SessionRecord:
    return SessionRecord(
        id=row.id,
        owner=row.owner,
        model=row.model,
        defaults=json.loads(row.defaults),
        metadata=json.loads(row.metadata),
        status=row.status,
        close_reason=row.close_reason,
        num_chunks=row.num_chunks,
        num_tokens=row.num_tokens,
        created=row.created,
        last_activity=row.last_activity,
        chat=None if row.chat is None else json.loads(row.chat),
    )


def _object(row: Any) -> StoredObject:
    return StoredObject(
        id=row.id,
        kind=row.kind,
        owner=row.owner,
        session_id=row.session_id,
        seq=row.seq,
        created=row.created,
        data=json.loads(row.data),
    )


def _replay(chunks: Any) -> list[int]:
    """A transcript from its chunks' (token ids, start) rows, in order: each cut replayed."""
    transcript: list[int] = []
    for data, start in chunks:
        if start is not None:
            del transcript[start:]
        transcript += unpack_tokens(data)
    return transcript


def _upgrade_to_head(connection: sa.Connection) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


class SQLSessionStore(SessionStore):
    def __init__(self, url: str):
        self.url = async_url(url)
        self._engine: AsyncEngine | None = None
        # SQLite: a pool of its own for lease writes, at synchronous=NORMAL (see _transaction).
        self._lease_engine: AsyncEngine | None = None
        # SQLite has one writer at a time: this process's writers queue here, in
        # order, rather than time out in SQLite's busy handler under load.
        self._sqlite_writer = asyncio.Lock()
        # Bound once: labels() is a lookup under a lock, and every chunk makes transactions.
        self._seconds = {kind: session_metrics().store_seconds.labels(kind) for kind in ("read", "write", "lease")}

    @property
    def dialect(self) -> str:
        return sa.make_url(self.url).get_backend_name()

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return self.dialect == "postgresql"

    async def start(self) -> None:
        if self.dialect == "sqlite":
            database = sa.make_url(self.url).database
            if database and database != ":memory:":
                Path(database).parent.mkdir(parents=True, exist_ok=True)
            engine = create_async_engine(self.url, hide_parameters=True, connect_args={"timeout": STATEMENT_TIMEOUT_S})
            sa.event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
            self._lease_engine = create_async_engine(
                self.url, hide_parameters=True, connect_args={"timeout": STATEMENT_TIMEOUT_S}
            )
            sa.event.listen(self._lease_engine.sync_engine, "connect", _sqlite_lease_pragmas)
        else:
            engine = create_async_engine(
                self.url,
                hide_parameters=True,
                pool_pre_ping=True,
                pool_size=5,
                max_overflow=5,
                pool_timeout=CONNECT_TIMEOUT_S,
                connect_args={"timeout": CONNECT_TIMEOUT_S, "command_timeout": STATEMENT_TIMEOUT_S},
            )
        self._engine = engine
        async with self._transaction() as conn:
            if self.dialect == "postgresql":
                await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            await conn.run_sync(_upgrade_to_head)
        logger.info(
            "session store: %s (%s)",
            sa.make_url(self.url).render_as_string(hide_password=True),
            ", ".join(f"{name}={value}" for name, value in (await self.durability()).items()),
        )

    async def durability(self) -> dict[str, str]:
        """The settings in force on the store's own connections that decide whether a
        committed chunk survives a power loss (SQLite: WAL and ``synchronous=FULL``;
        PostgreSQL: ``fsync`` and ``synchronous_commit`` on)."""
        names = ("journal_mode", "synchronous") if self.dialect == "sqlite" else ("fsync", "synchronous_commit")
        query = "PRAGMA {}" if self.dialect == "sqlite" else "SHOW {}"
        async with self._transaction(write=False) as conn:
            values = {
                name: str((await conn.execute(sa.text(query.format(name)))).scalar_one()).lower() for name in names
            }
        if self.dialect == "sqlite":
            values["synchronous"] = _SQLITE_SYNCHRONOUS.get(values["synchronous"], values["synchronous"])
        return values

    async def close(self) -> None:
        for engine in (self._engine, self._lease_engine):
            if engine is not None:
                await engine.dispose()

    async def ping(self) -> None:
        async with self._transaction(write=False) as conn:
            await conn.execute(sa.text("SELECT 1"))

    @contextlib.asynccontextmanager
    async def _transaction(self, write: bool = True, synced: bool = True) -> AsyncIterator[AsyncConnection]:
        """One transaction; any failure of the database or its disk becomes
        StoreUnavailableError, after the transaction rolled back. ``synced=False`` (lease
        writes): the commit returns before it is on disk. A lease lost to a power loss or a
        database crash is harmless: its holder's commit checks it (and is refused), and a
        holder lost with it needs no lease. That takes a flush off every chunk's first
        token (SQLite: a connection at synchronous=NORMAL; PostgreSQL: synchronous_commit
        off for this transaction); chunks, sessions and objects stay synced."""
        assert self._engine is not None, "start() the store first"
        writer = self._sqlite_writer if write and self.dialect == "sqlite" else contextlib.nullcontext()
        engine = self._lease_engine if not synced and self._lease_engine is not None else self._engine
        started = time.perf_counter()
        try:
            async with writer, engine.begin() as conn:
                if not synced and self.dialect == "postgresql":
                    await conn.execute(sa.text("SET LOCAL synchronous_commit = off"))
                yield conn
        except IntegrityError:
            raise
        except (TimeoutError, SQLAlchemyError, OSError) as exc:
            raise StoreUnavailableError(f"the session store failed: {exc}") from exc
        finally:
            kind = "read" if not write else "write" if synced else "lease"
            self._seconds[kind].observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ rows
    async def create(self, record: SessionRecord) -> None:
        try:
            async with self._transaction() as conn:
                await conn.execute(
                    sessions.insert().values(
                        id=record.id,
                        owner=record.owner,
                        model=record.model,
                        defaults=json.dumps(record.defaults),
                        metadata=json.dumps(record.metadata),
                        status=record.status,
                        close_reason=record.close_reason,
                        num_chunks=record.num_chunks,
                        num_tokens=record.num_tokens,
                        created=record.created,
                        last_activity=record.last_activity,
                        chat=None if record.chat is None else json.dumps(record.chat),
                    )
                )
        except IntegrityError as exc:
            raise SessionExistsError(record.id) from exc

    async def get(self, session_id: str) -> SessionRecord | None:
        async with self._transaction(write=False) as conn:
            row = (await conn.execute(sa.select(*RECORD_COLUMNS).where(sessions.c.id == session_id))).first()
        return None if row is None else _record(row)

    async def load(self, session_id: str) -> tuple[SessionRecord, list[int]] | None:
        async with self._transaction(write=False) as conn:
            row = (await conn.execute(sa.select(*RECORD_COLUMNS).where(sessions.c.id == session_id))).first()
            if row is None:
                return None
            transcript = _replay(await conn.execute(self._chunks(session_id)))
        return _record(row), transcript

    async def transcript_at(self, session_id: str, num_chunks: int) -> list[int] | None:
        async with self._transaction(write=False) as conn:
            return _replay(await conn.execute(self._chunks(session_id).where(session_chunks.c.idx < num_chunks)))

    @staticmethod
    def _chunks(session_id: str) -> Any:
        return (
            sa.select(session_chunks.c.token_ids, session_chunks.c.start)
            .where(session_chunks.c.session_id == session_id)
            .order_by(session_chunks.c.idx)
        )

    async def list_open(self, owner: str) -> list[SessionRecord]:
        query = (
            sa.select(*RECORD_COLUMNS)
            .where(sessions.c.owner == owner, sessions.c.status != "closed")
            .order_by(sessions.c.created, sessions.c.id)
        )
        async with self._transaction(write=False) as conn:
            return [_record(row) for row in await conn.execute(query)]

    async def update(self, session_id: str, **fields: Any) -> None:
        allowed = {"defaults", "metadata", "status", "close_reason", "last_activity"}
        if unknown := set(fields) - allowed:
            raise ValueError(f"cannot update {sorted(unknown)}")
        for name in ("defaults", "metadata"):
            if name in fields:
                fields[name] = json.dumps(fields[name])
        async with self._transaction() as conn:
            await conn.execute(sessions.update().where(sessions.c.id == session_id).values(**fields))

    # ------------------------------------------------------------------ replicas
    async def join(self, replica_id: str, instance: str, ttl_s: float) -> float | None:
        now = time.time()
        c = replicas.c
        async with self._transaction() as conn:
            row = (await conn.execute(sa.select(c.instance, c.heartbeat).where(c.id == replica_id))).first()
            if row is not None and row.instance != instance and row.heartbeat > now - ttl_s:
                return now - float(row.heartbeat)
            if row is None:
                await conn.execute(replicas.insert().values(id=replica_id, instance=instance, heartbeat=now))
            else:
                await conn.execute(replicas.update().where(c.id == replica_id).values(instance=instance, heartbeat=now))
        return None

    async def heartbeat(self, replica_id: str, instance: str) -> bool:
        c = replicas.c
        async with self._transaction(synced=False) as conn:
            result = await conn.execute(
                replicas.update().where(c.id == replica_id, c.instance == instance).values(heartbeat=time.time())
            )
        return result.rowcount == 1

    async def leave(self, replica_id: str, instance: str) -> None:
        c = replicas.c
        async with self._transaction() as conn:
            await conn.execute(replicas.delete().where(c.id == replica_id, c.instance == instance))

    async def shared_value(self, name: str, proposed: str) -> str:
        try:
            async with self._transaction() as conn:
                await conn.execute(cluster.insert().values(name=name, value=proposed))
        except IntegrityError:
            pass  # another replica's came first: it is the one
        async with self._transaction(write=False) as conn:
            return str((await conn.execute(sa.select(cluster.c.value).where(cluster.c.name == name))).scalar())

    # ------------------------------------------------------------------ leases
    async def acquire_lease(self, session_id: str, holder: str, ttl_s: float) -> SessionRecord | LeaseRefused:
        now = time.time()
        c = sessions.c
        takeable = sa.or_(c.lease_holder.is_(None), c.lease_holder == holder, c.lease_expires < now)
        query = (
            sessions.update()
            .where(c.id == session_id, c.status != "closed", takeable)
            .values(lease_holder=holder, lease_expires=now + ttl_s)
            .returning(*RECORD_COLUMNS)
        )
        async with self._transaction(synced=False) as conn:
            row = (await conn.execute(query)).first()
            if row is not None:
                return _record(row)
            status = (await conn.execute(sa.select(c.status).where(c.id == session_id))).scalar()
        if status is None:
            return LeaseRefused.NOT_FOUND
        return LeaseRefused.CLOSED if status == "closed" else LeaseRefused.HELD

    async def renew_lease(self, session_id: str, holder: str, ttl_s: float) -> bool:
        c = sessions.c
        async with self._transaction(synced=False) as conn:
            result = await conn.execute(
                sessions.update()
                .where(c.id == session_id, c.lease_holder == holder)
                .values(lease_expires=time.time() + ttl_s)
            )
        return result.rowcount == 1

    async def release_lease(self, session_id: str, holder: str) -> None:
        c = sessions.c
        async with self._transaction(synced=False) as conn:
            await conn.execute(
                sessions.update()
                .where(c.id == session_id, c.lease_holder == holder)
                .values(lease_holder=None, lease_expires=None)
            )

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
        c = sessions.c
        num_tokens = c.num_tokens + len(token_ids) if start is None else start + len(token_ids)
        try:
            async with self._transaction() as conn:
                result = await conn.execute(
                    sessions.update()
                    .where(c.id == session_id, c.lease_holder == holder, c.num_chunks == index)
                    .values(
                        num_chunks=index + 1,
                        num_tokens=num_tokens,
                        chat=None if chat is None else json.dumps(chat),
                        last_activity=last_activity,
                        status="active",
                        lease_holder=None,
                        lease_expires=None,
                    )
                )
                if result.rowcount != 1:
                    return False
                await conn.execute(
                    session_chunks.insert().values(
                        session_id=session_id, idx=index, token_ids=pack_tokens(token_ids), start=start
                    )
                )
        except IntegrityError:
            return False  # chunk ``index`` exists: written by another replica
        return True

    async def expire(self, idle_before: float, purge_closed_before: float) -> int:
        c = sessions.c
        now = time.time()
        async with self._transaction() as conn:
            closed = await conn.execute(
                sessions.update()
                .where(
                    c.status != "closed",
                    c.last_activity < idle_before,
                    sa.or_(c.lease_holder.is_(None), c.lease_expires < now),
                )
                .values(
                    status="closed", close_reason="expired", last_activity=now, lease_holder=None, lease_expires=None
                )
            )
            stale = sa.select(c.id).where(c.status == "closed", c.last_activity < purge_closed_before)
            await conn.execute(session_chunks.delete().where(session_chunks.c.session_id.in_(stale)))
            await conn.execute(api_objects.delete().where(api_objects.c.session_id.in_(stale)))
            await conn.execute(sessions.delete().where(c.status == "closed", c.last_activity < purge_closed_before))
        return closed.rowcount

    # ------------------------------------------------------------------ objects
    async def put_objects(self, objects: list[StoredObject]) -> None:
        async with self._transaction() as conn:
            for obj in objects:
                values = {
                    "kind": obj.kind,
                    "owner": obj.owner,
                    "session_id": obj.session_id,
                    "seq": obj.seq,
                    "created": obj.created,
                    "data": json.dumps(obj.data),
                }
                updated = await conn.execute(api_objects.update().where(api_objects.c.id == obj.id).values(**values))
                if updated.rowcount == 0:
                    await conn.execute(api_objects.insert().values(id=obj.id, **values))

    async def get_object(self, kind: str, object_id: str) -> StoredObject | None:
        query = sa.select(api_objects).where(api_objects.c.id == object_id, api_objects.c.kind == kind)
        async with self._transaction(write=False) as conn:
            row = (await conn.execute(query)).first()
        return None if row is None else _object(row)

    async def list_objects(self, kind: str, session_id: str) -> list[StoredObject]:
        query = (
            sa.select(api_objects)
            .where(api_objects.c.session_id == session_id, api_objects.c.kind == kind)
            .order_by(api_objects.c.seq)
        )
        async with self._transaction(write=False) as conn:
            return [_object(row) for row in await conn.execute(query)]

    async def delete_object(self, kind: str, object_id: str) -> bool:
        async with self._transaction() as conn:
            result = await conn.execute(
                api_objects.delete().where(api_objects.c.id == object_id, api_objects.c.kind == kind)
            )
        return bool(result.rowcount)


_SQLITE_SYNCHRONOUS = {"0": "off", "1": "normal", "2": "full", "3": "extra"}


def _sqlite_pragmas(dbapi_connection: Any, _connection_record: Any, synchronous: str = "FULL") -> None:
    cursor = dbapi_connection.cursor()
    # WAL: readers do not block the writer; FULL: a commit is on disk before it returns.
    for pragma in ("journal_mode=WAL", f"synchronous={synchronous}", "foreign_keys=ON", "busy_timeout=10000"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_lease_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    # NORMAL in WAL mode: a commit survives a killed process, not a power loss (leases only).
    _sqlite_pragmas(dbapi_connection, connection_record, synchronous="NORMAL")
