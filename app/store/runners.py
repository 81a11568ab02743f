"""How the session store's transactions run on each database.

A store call is one transaction, written once as synchronous SQLAlchemy Core over a
``sa.Connection`` (a ``Transaction``); a runner runs it whole. SQLite: the standard
library's ``sqlite3`` on threads of the store's own, one hop from the event loop a
transaction. PostgreSQL: asyncpg, the same body through ``run_sync``. Each runner has a
second pool for lease writes, whose commits are not flushed (see ``SQLSessionStore._run``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

# How long a statement may take before the store counts as unavailable.
STATEMENT_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0

T = TypeVar("T")
# One transaction's statements, on one connection; the runner begins and commits it.
Transaction = Callable[[sa.Connection], T]


def driver_url(url: str) -> str:
    """The URL with the driver the store runs it on: SQLite through the standard
    library's ``sqlite3``, PostgreSQL through asyncpg."""
    for given, driver in (
        ("sqlite+aiosqlite://", "sqlite://"),
        ("postgresql://", "postgresql+asyncpg://"),
        ("postgres://", "postgresql+asyncpg://"),
    ):
        if url.startswith(given):
            return driver + url[len(given) :]
    return url


def _whole(engine: sa.Engine, transaction: Transaction[T]) -> T:
    with engine.begin() as conn:
        return transaction(conn)


class SQLiteRunner:
    """SQLite's transactions, each run whole on a thread of ours: one hop from the event
    loop and back a transaction, where an async driver (aiosqlite) takes one a statement
    (a lease and a chunk's commit took ~3 ms of hops and ~0.4 ms of SQLite). One writer
    thread, because SQLite has one writer at a time: this process's writes queue there in
    order rather than time out in SQLite's busy handler under load. Readers have threads
    of their own (WAL: a reader does not block the writer)."""

    def __init__(self, url: str):
        database = sa.make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        # Connections move between the threads, one thread at a time (the pool's checkout).
        connect_args = {"timeout": STATEMENT_TIMEOUT_S, "check_same_thread": False}
        self.engine = sa.create_engine(url, hide_parameters=True, connect_args=connect_args)
        sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        # Lease writes: a pool of its own at synchronous=NORMAL (see SQLSessionStore._run).
        self.lease_engine = sa.create_engine(url, hide_parameters=True, connect_args=connect_args)
        sa.event.listen(self.lease_engine, "connect", _sqlite_lease_pragmas)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="store-writer")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="store-reader")

    async def run(self, transaction: Transaction[T], write: bool, synced: bool, one_statement: bool) -> T:
        engine = self.engine if synced else self.lease_engine
        executor = self._writer if write else self._readers
        return await asyncio.get_running_loop().run_in_executor(executor, _whole, engine, transaction)

    async def close(self) -> None:
        for executor in (self._writer, self._readers):
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
        self.engine.dispose()
        self.lease_engine.dispose()


class PostgresRunner:
    """PostgreSQL's transactions on asyncpg (no threads), the same synchronous body run
    through ``run_sync``. Lease writes have a pool of their own whose connections commit
    with ``synchronous_commit`` off (a session setting, so no statement a lease). A
    connection is pinged at checkout only when it has been idle a while (a ping on every
    checkout, SQLAlchemy's ``pool_pre_ping``, is a round trip on every transaction: 0.3
    to 0.6 ms here); one in use a moment ago is alive, or the transaction that lost it
    failed and invalidated the pool."""

    def __init__(self, url: str):
        options: dict[str, Any] = {"hide_parameters": True, "pool_timeout": CONNECT_TIMEOUT_S}
        connect_args: dict[str, Any] = {"timeout": CONNECT_TIMEOUT_S, "command_timeout": STATEMENT_TIMEOUT_S}
        self.engine: AsyncEngine = create_async_engine(
            url, pool_size=5, max_overflow=5, connect_args=connect_args, **options
        )
        self.lease_engine: AsyncEngine = create_async_engine(
            url,
            pool_size=2,
            max_overflow=3,
            connect_args={**connect_args, "server_settings": {"synchronous_commit": "off"}},
            **options,
        )
        for engine in (self.engine, self.lease_engine):
            _ping_when_idle(engine.sync_engine)

    async def run(self, transaction: Transaction[T], write: bool, synced: bool, one_statement: bool) -> T:
        engine = self.engine if synced else self.lease_engine
        if one_statement:  # atomic by itself: no BEGIN and COMMIT, two round trips less
            async with engine.connect() as conn:
                autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
                return await autocommit.run_sync(transaction)
        async with engine.begin() as conn:
            return await conn.run_sync(transaction)

    async def close(self) -> None:
        await self.engine.dispose()
        await self.lease_engine.dispose()


# A pooled connection idle longer than this is pinged before it is handed out.
IDLE_PING_S = 1.0


def _ping_when_idle(engine: sa.Engine) -> None:
    def checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get("idle_since", 0.0) < IDLE_PING_S:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise sa.exc.DisconnectionError() from exc  # the pool retries on a new connection

    sa.event.listen(engine, "checkin", checked_in)
    sa.event.listen(engine, "checkout", checkout)


def _sqlite_pragmas(dbapi_connection: Any, _connection_record: Any, synchronous: str = "FULL") -> None:
    cursor = dbapi_connection.cursor()
    # WAL: readers do not block the writer; FULL: a commit is on disk before it returns.
    for pragma in ("journal_mode=WAL", f"synchronous={synchronous}", "foreign_keys=ON", "busy_timeout=10000"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_lease_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    # NORMAL in WAL mode: a commit survives a killed process, not a power loss (leases only).
    _sqlite_pragmas(dbapi_connection, connection_record, synchronous="NORMAL")
