"""The session store on SQL: SQLite (the default) or PostgreSQL, through SQLAlchemy.

One code path for both: each store call is one transaction, written once as synchronous
SQLAlchemy Core over a ``sa.Connection`` and run whole by the dialect's runner
(``app.store.runners``). The schema is Alembic's (``migrations/``),
brought to its newest version at start, under an advisory lock on PostgreSQL so replicas
starting together do not race.

Errors never carry statement parameters (``hide_parameters``): a failure logged
at the default level holds no session metadata. Durability: SQLite runs in WAL mode with ``synchronous=FULL``, so a committed chunk
survives a killed process and a power loss; PostgreSQL commits as it is configured.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from array import array
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from app.metrics import session_metrics
from app.store.base import (
    LeaseRefused,
    SessionExistsError,
    SessionRecord,
    SessionStore,
    StoredObject,
    StoreUnavailableError,
)
from app.store.runners import PostgresRunner, SQLiteRunner, T, Transaction, driver_url

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: the key of the PostgreSQL advisory lock held while migrating.
MIGRATION_LOCK_KEY = 0x5E55_1045

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

# Every chunk's statements, built once: building one takes ~0.1 ms of the event loop.
_s = sessions.c
TAKE_LEASE = (
    sessions.update()
    .where(
        _s.id == sa.bindparam("sid"),
        _s.status != "closed",
        sa.or_(
            _s.lease_holder.is_(None), _s.lease_holder == sa.bindparam("holder"), _s.lease_expires < sa.bindparam("now")
        ),
    )
    .values(lease_holder=sa.bindparam("holder"), lease_expires=sa.bindparam("expires"))
    .returning(*RECORD_COLUMNS)
)
SESSION_STATUS = sa.select(_s.status).where(_s.id == sa.bindparam("sid"))
_HELD = sessions.update().where(_s.id == sa.bindparam("sid"), _s.lease_holder == sa.bindparam("holder"))
RENEW_LEASE = _HELD.values(lease_expires=sa.bindparam("expires"))
RELEASE_LEASE = _HELD.values(lease_holder=None, lease_expires=None)
# A chunk extends its session (while its holder has the lease and no other chunk came in
# between), then its tokens are added; a chunk that cut the context says where it starts.
_EXTEND = sessions.update().where(
    _s.id == sa.bindparam("sid"), _s.lease_holder == sa.bindparam("holder"), _s.num_chunks == sa.bindparam("chunk_idx")
)
_EXTENDED: dict[str, Any] = {
    "num_chunks": sa.bindparam("next_idx"),
    "chat": sa.bindparam("chat_json"),
    "last_activity": sa.bindparam("activity"),
    "status": "active",
    "lease_holder": None,
    "lease_expires": None,
}
EXTEND_AT_END = _EXTEND.values(num_tokens=_s.num_tokens + sa.bindparam("added"), **_EXTENDED)
EXTEND_CUT = _EXTEND.values(num_tokens=sa.bindparam("total"), **_EXTENDED)
ADD_CHUNK = session_chunks.insert()


def _extend_and_add(extend: sa.Update) -> sa.Insert:
    """Both of a chunk's writes as one statement (PostgreSQL: an UPDATE in a WITH clause),
    which adds the chunk's row only where the session was extended."""
    extended = extend.returning(_s.id).cte("extended")
    chunk = sa.select(
        extended.c.id,
        sa.bindparam("chunk_idx", type_=sa.Integer),
        sa.bindparam("chunk_tokens", type_=sa.LargeBinary),
        sa.bindparam("chunk_start", type_=sa.Integer),
    )
    return session_chunks.insert().from_select(["session_id", "idx", "token_ids", "start"], chunk)


EXTEND_AND_ADD = {at_end: _extend_and_add(EXTEND_AT_END if at_end else EXTEND_CUT) for at_end in (True, False)}


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


# A session row's columns that hold JSON text (``chat`` may be NULL).
JSON_COLUMNS = ("defaults", "metadata", "chat")


def _record(row: Any) -> SessionRecord:
    fields = dict(row._mapping)
    for name in JSON_COLUMNS:
        fields[name] = None if fields[name] is None else json.loads(fields[name])
    return SessionRecord(**fields)


def _row(record: SessionRecord) -> dict[str, Any]:
    values = dataclasses.asdict(record)
    for name in JSON_COLUMNS:
        values[name] = None if values[name] is None else json.dumps(values[name])
    return values


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
        self.url = driver_url(url)
        # "sqlite" or "postgresql": parsed once, a chunk's commit reads it.
        self.dialect: str = sa.make_url(self.url).get_backend_name()
        self._runner: SQLiteRunner | PostgresRunner | None = None
        # Bound once: labels() is a lookup under a lock, and every chunk makes transactions.
        self._seconds = {kind: session_metrics().store_seconds.labels(kind) for kind in ("read", "write", "lease")}

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return self.dialect == "postgresql"

    async def start(self) -> None:
        self._runner = SQLiteRunner(self.url) if self.dialect == "sqlite" else PostgresRunner(self.url)
        postgresql = self.dialect == "postgresql"

        def migrate(conn: sa.Connection) -> None:
            if postgresql:
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            _upgrade_to_head(conn)

        await self._run(migrate)
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

        def read(conn: sa.Connection) -> dict[str, str]:
            return {name: str(conn.execute(sa.text(query.format(name))).scalar_one()).lower() for name in names}

        values = await self._run(read, write=False)
        if self.dialect == "sqlite":
            values["synchronous"] = _SQLITE_SYNCHRONOUS.get(values["synchronous"], values["synchronous"])
        return values

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.close()

    async def ping(self) -> None:
        await self._run(lambda conn: conn.execute(sa.text("SELECT 1")).scalar(), write=False)

    async def _run(
        self, transaction: Transaction[T], write: bool = True, synced: bool = True, one_statement: bool = False
    ) -> T:
        """``transaction`` as one transaction; any failure of the database or its disk
        becomes StoreUnavailableError, after the transaction rolled back. ``synced=False``
        (lease writes): the commit returns before it is on disk. A lease lost to a power
        loss or a database crash is harmless: its holder's commit checks it (and is
        refused), and a holder lost with it needs none. That takes a flush off every
        chunk's first token (SQLite: a connection at synchronous=NORMAL; PostgreSQL:
        synchronous_commit off on the lease pool's connections); chunks, sessions and
        objects stay synced. ``one_statement``: the transaction's one write is a single
        statement, atomic by itself (anything after it only reads), which PostgreSQL runs
        without BEGIN and COMMIT: a chunk's lease and commit are then a round trip each."""
        assert self._runner is not None, "start() the store first"
        started = time.perf_counter()
        try:
            return await self._runner.run(transaction, write, synced, one_statement)
        except IntegrityError:
            raise
        except (TimeoutError, SQLAlchemyError, OSError) as exc:
            raise StoreUnavailableError(f"the session store failed: {exc}") from exc
        finally:
            kind = "read" if not write else "write" if synced else "lease"
            self._seconds[kind].observe(time.perf_counter() - started)

    # ------------------------------------------------------------------ rows
    async def create(self, record: SessionRecord) -> None:
        insert = sessions.insert().values(**_row(record))
        try:
            await self._run(lambda conn: conn.execute(insert))
        except IntegrityError as exc:
            raise SessionExistsError(record.id) from exc

    async def get(self, session_id: str) -> SessionRecord | None:
        query = sa.select(*RECORD_COLUMNS).where(sessions.c.id == session_id)
        row = await self._run(lambda conn: conn.execute(query).first(), write=False)
        return None if row is None else _record(row)

    async def load(self, session_id: str) -> tuple[SessionRecord, list[int]] | None:
        def read(conn: sa.Connection) -> tuple[SessionRecord, list[int]] | None:
            row = conn.execute(sa.select(*RECORD_COLUMNS).where(sessions.c.id == session_id)).first()
            if row is None:
                return None
            return _record(row), _replay(conn.execute(self._chunks(session_id)))

        return await self._run(read, write=False)

    async def transcript_at(self, session_id: str, num_chunks: int) -> list[int] | None:
        query = self._chunks(session_id).where(session_chunks.c.idx < num_chunks)
        return await self._run(lambda conn: _replay(conn.execute(query)), write=False)

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
        return await self._run(lambda conn: [_record(row) for row in conn.execute(query)], write=False)

    async def update(self, session_id: str, **fields: Any) -> None:
        allowed = {"defaults", "metadata", "status", "close_reason", "last_activity"}
        if unknown := set(fields) - allowed:
            raise ValueError(f"cannot update {sorted(unknown)}")
        for name in ("defaults", "metadata"):
            if name in fields:
                fields[name] = json.dumps(fields[name])
        statement = sessions.update().where(sessions.c.id == session_id).values(**fields)
        await self._run(lambda conn: conn.execute(statement))

    # ------------------------------------------------------------------ replicas
    async def join(self, replica_id: str, instance: str, ttl_s: float) -> float | None:
        now = time.time()
        c = replicas.c

        def claim(conn: sa.Connection) -> float | None:
            row = conn.execute(sa.select(c.instance, c.heartbeat).where(c.id == replica_id)).first()
            if row is not None and row.instance != instance and row.heartbeat > now - ttl_s:
                return now - float(row.heartbeat)
            if row is None:
                conn.execute(replicas.insert().values(id=replica_id, instance=instance, heartbeat=now))
            else:
                conn.execute(replicas.update().where(c.id == replica_id).values(instance=instance, heartbeat=now))
            return None

        return await self._run(claim)

    async def heartbeat(self, replica_id: str, instance: str) -> bool:
        c = replicas.c
        statement = replicas.update().where(c.id == replica_id, c.instance == instance).values(heartbeat=time.time())
        return await self._run(lambda conn: conn.execute(statement).rowcount == 1, synced=False)

    async def leave(self, replica_id: str, instance: str) -> None:
        c = replicas.c
        await self._run(lambda conn: conn.execute(replicas.delete().where(c.id == replica_id, c.instance == instance)))

    async def shared_value(self, name: str, proposed: str) -> str:
        try:
            await self._run(lambda conn: conn.execute(cluster.insert().values(name=name, value=proposed)))
        except IntegrityError:
            pass  # another replica's came first: it is the one
        query = sa.select(cluster.c.value).where(cluster.c.name == name)
        return str(await self._run(lambda conn: conn.execute(query).scalar(), write=False))

    # ------------------------------------------------------------------ leases
    async def acquire_lease(self, session_id: str, holder: str, ttl_s: float) -> SessionRecord | LeaseRefused:
        now = time.time()

        def take(conn: sa.Connection) -> SessionRecord | LeaseRefused:
            row = conn.execute(TAKE_LEASE, {"sid": session_id, "holder": holder, "now": now, "expires": now + ttl_s})
            granted = row.first()
            if granted is not None:
                return _record(granted)
            status = conn.execute(SESSION_STATUS, {"sid": session_id}).scalar()
            if status is None:
                return LeaseRefused.NOT_FOUND
            return LeaseRefused.CLOSED if status == "closed" else LeaseRefused.HELD

        return await self._run(take, synced=False, one_statement=True)

    async def renew_lease(self, session_id: str, holder: str, ttl_s: float) -> bool:
        values = {"sid": session_id, "holder": holder, "expires": time.time() + ttl_s}
        renew = lambda conn: conn.execute(RENEW_LEASE, values).rowcount == 1  # noqa: E731
        return await self._run(renew, synced=False, one_statement=True)

    async def release_lease(self, session_id: str, holder: str) -> None:
        values = {"sid": session_id, "holder": holder}
        await self._run(lambda conn: conn.execute(RELEASE_LEASE, values), synced=False, one_statement=True)

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
        extend = EXTEND_AT_END if start is None else EXTEND_CUT
        values = {
            "sid": session_id,
            "holder": holder,
            "chunk_idx": index,
            "next_idx": index + 1,
            "chat_json": None if chat is None else json.dumps(chat),
            "activity": last_activity,
            "added": len(token_ids),
            "total": (start or 0) + len(token_ids),
        }
        tokens = pack_tokens(token_ids)

        def write(conn: sa.Connection) -> bool:
            if conn.execute(extend, values).rowcount != 1:
                return False
            conn.execute(ADD_CHUNK, {"session_id": session_id, "idx": index, "token_ids": tokens, "start": start})
            return True

        def write_one(conn: sa.Connection) -> bool:
            added = conn.execute(
                EXTEND_AND_ADD[start is None], {**values, "chunk_tokens": tokens, "chunk_start": start}
            )
            return bool(added.rowcount == 1)

        try:
            if self.dialect == "postgresql":
                return await self._run(write_one, one_statement=True)
            return await self._run(write)
        except IntegrityError:
            return False  # chunk ``index`` exists: written by another replica

    async def expire(self, idle_before: float, purge_closed_before: float) -> int:
        c = sessions.c
        now = time.time()

        def sweep(conn: sa.Connection) -> int:
            closed = conn.execute(
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
            conn.execute(session_chunks.delete().where(session_chunks.c.session_id.in_(stale)))
            conn.execute(api_objects.delete().where(api_objects.c.session_id.in_(stale)))
            conn.execute(sessions.delete().where(c.status == "closed", c.last_activity < purge_closed_before))
            return int(closed.rowcount)

        return await self._run(sweep)

    # ------------------------------------------------------------------ objects
    async def put_objects(self, objects: list[StoredObject]) -> None:
        def write(conn: sa.Connection) -> None:
            for obj in objects:
                values = {
                    "kind": obj.kind,
                    "owner": obj.owner,
                    "session_id": obj.session_id,
                    "seq": obj.seq,
                    "created": obj.created,
                    "data": json.dumps(obj.data),
                }
                updated = conn.execute(api_objects.update().where(api_objects.c.id == obj.id).values(**values))
                if updated.rowcount == 0:
                    conn.execute(api_objects.insert().values(id=obj.id, **values))

        await self._run(write)

    async def get_object(self, kind: str, object_id: str) -> StoredObject | None:
        query = sa.select(api_objects).where(api_objects.c.id == object_id, api_objects.c.kind == kind)
        row = await self._run(lambda conn: conn.execute(query).first(), write=False)
        return None if row is None else _object(row)

    async def list_objects(self, kind: str, session_id: str) -> list[StoredObject]:
        query = (
            sa.select(api_objects)
            .where(api_objects.c.session_id == session_id, api_objects.c.kind == kind)
            .order_by(api_objects.c.seq)
        )
        return await self._run(lambda conn: [_object(row) for row in conn.execute(query)], write=False)

    async def delete_object(self, kind: str, object_id: str) -> bool:
        statement = api_objects.delete().where(api_objects.c.id == object_id, api_objects.c.kind == kind)
        return await self._run(lambda conn: bool(conn.execute(statement).rowcount))


_SQLITE_SYNCHRONOUS = {"0": "off", "1": "normal", "2": "full", "3": "extra"}
