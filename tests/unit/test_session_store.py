"""The session store's contract, on SQLite and on a real PostgreSQL server.

No engine: these check what the service relies on. Rows and transcripts survive a
new store object on the same database (a restart); a chunk lease admits one
holder at a time and expires when not renewed (a lost replica); a commit is whole
or absent; a store that cannot write raises StoreUnavailableError and keeps what
it had.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy as sa

from app.store import LeaseRefused, SessionExistsError, SessionRecord, StoreUnavailableError
from app.store.runners import SQLiteRunner
from app.store.sql import SQLSessionStore
from tests.postgres import PostgresServer, needs_postgres, postgres_server


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=needs_postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'sessions.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.url


@pytest_asyncio.fixture
async def store(store_url: str) -> AsyncIterator[SQLSessionStore]:
    opened = SQLSessionStore(store_url)
    await opened.start()
    yield opened
    await opened.close()


def record(session_id: str, owner: str = "alice") -> SessionRecord:
    now = time.time()
    return SessionRecord(
        id=session_id,
        owner=owner,
        model="m",
        defaults={"temperature": 0.0},
        metadata={"k": "v"},
        status="active",
        close_reason=None,
        num_chunks=0,
        num_tokens=0,
        created=now,
        last_activity=now,
    )


def unique(name: str) -> str:
    return f"{name}-{time.monotonic_ns()}"  # the PostgreSQL database is shared by the module


async def test_a_session_and_its_transcript_outlive_the_store_object(store: SQLSessionStore, store_url: str) -> None:
    session_id = unique("durable")
    await store.create(record(session_id))
    with pytest.raises(SessionExistsError):
        await store.create(record(session_id))
    for index, tokens in enumerate(([1, 2, 3], [2**31 - 1, 0], [7])):
        assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
        assert await store.commit_chunk(session_id, "replica-a", index, tokens, time.time())
    await store.update(session_id, defaults={"temperature": 0.5, "max_tokens": 3})
    await store.close()

    reopened = SQLSessionStore(store_url)  # a restart: migrations find the schema current
    await reopened.start()
    try:
        loaded = await reopened.load(session_id)
        assert loaded is not None
        row, transcript = loaded
        assert transcript == [1, 2, 3, 2**31 - 1, 0, 7]
        assert (row.num_chunks, row.num_tokens, row.defaults) == (3, 6, {"temperature": 0.5, "max_tokens": 3})
        assert row.metadata == {"k": "v"} and row.status == "active"
        assert [r.id for r in await reopened.list_open("alice") if r.id == session_id] == [session_id]
        assert not [r for r in await reopened.list_open("bob") if r.id == session_id]
        await reopened.update(session_id, status="closed", close_reason="deleted")
        assert not [r for r in await reopened.list_open("alice") if r.id == session_id]
        assert await reopened.acquire_lease(session_id, "replica-a", 30) is LeaseRefused.CLOSED
        assert await reopened.acquire_lease(unique("missing"), "replica-a", 30) is LeaseRefused.NOT_FOUND
    finally:
        await reopened.close()


async def test_a_chunk_that_cuts_the_transcript_is_loaded_cut(store: SQLSessionStore) -> None:
    """A re-rendered chat turn keeps a prefix of the context and replaces the rest: its
    chunk records where it starts, and a load replays the cut."""
    session_id = unique("cut")
    await store.create(record(session_id))
    for index, (tokens, start) in enumerate((([1, 2, 3, 4], None), ([5, 6], None), ([9, 9, 9], 3), ([8], None))):
        assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
        assert await store.commit_chunk(session_id, "replica-a", index, tokens, time.time(), start=start)
    loaded = await store.load(session_id)
    assert loaded is not None
    row, transcript = loaded
    assert transcript == [1, 2, 3, 9, 9, 9, 8]
    assert (row.num_chunks, row.num_tokens) == (4, 7)


async def test_one_lease_holder_at_a_time_and_a_lost_holders_lease_expires(store: SQLSessionStore) -> None:
    session_id = unique("leased")
    await store.create(record(session_id))
    assert isinstance(await store.acquire_lease(session_id, "replica-a", 0.5), SessionRecord)
    assert await store.acquire_lease(session_id, "replica-b", 30) is LeaseRefused.HELD
    # Re-entrant for its holder (a restarted replica keeps its name).
    assert isinstance(await store.acquire_lease(session_id, "replica-a", 0.5), SessionRecord)
    assert await store.renew_lease(session_id, "replica-a", 0.5)
    assert not await store.renew_lease(session_id, "replica-b", 30)
    # replica-a is gone and its lease runs out: renewed to an expiry in the past, as
    # time would (a sleep past a short lease raced a slow machine).
    assert await store.renew_lease(session_id, "replica-a", -1)
    taken = await store.acquire_lease(session_id, "replica-b", 30)
    assert isinstance(taken, SessionRecord) and taken.num_chunks == 0
    # The old holder's late commit is refused, and writes nothing.
    assert not await store.commit_chunk(session_id, "replica-a", 0, [1, 2], time.time())
    assert await store.commit_chunk(session_id, "replica-b", 0, [3], time.time())
    loaded = await store.load(session_id)
    assert loaded is not None and loaded[1] == [3] and loaded[0].num_chunks == 1
    # The commit released the lease; a commit for a chunk index taken already fails.
    assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
    assert not await store.commit_chunk(session_id, "replica-a", 0, [9], time.time())
    await store.release_lease(session_id, "replica-a")
    assert isinstance(await store.acquire_lease(session_id, "replica-b", 30), SessionRecord)


async def test_concurrent_lease_requests_admit_exactly_one(store: SQLSessionStore) -> None:
    session_id = unique("raced")
    await store.create(record(session_id))
    granted = await asyncio.gather(*(store.acquire_lease(session_id, f"replica-{i}", 30) for i in range(8)))
    assert sum(isinstance(g, SessionRecord) for g in granted) == 1
    assert all(g is LeaseRefused.HELD for g in granted if not isinstance(g, SessionRecord))


async def test_expiry_uses_the_stored_last_activity_and_purges_old_closed_sessions(store: SQLSessionStore) -> None:
    idle, fresh, leased = unique("idle"), unique("fresh"), unique("leased")
    for session_id in (idle, fresh, leased):
        await store.create(record(session_id))
    await store.update(idle, last_activity=time.time() - 100)
    await store.update(leased, last_activity=time.time() - 100)
    assert isinstance(await store.acquire_lease(leased, "replica-a", 30), SessionRecord)  # a chunk runs
    await store.expire(idle_before=time.time() - 50, purge_closed_before=0)
    states = {s: (await store.get(s)) for s in (idle, fresh, leased)}
    assert states[idle] is not None and (states[idle].status, states[idle].close_reason) == ("closed", "expired")
    assert states[fresh] is not None and states[fresh].status == "active"
    assert states[leased] is not None and states[leased].status == "active"
    await store.expire(idle_before=0, purge_closed_before=time.time() + 1)
    assert await store.get(idle) is None and await store.load(idle) is None


@needs_postgres
async def test_a_stopped_postgres_fails_fast_and_the_store_recovers(postgres: PostgresServer) -> None:
    store = SQLSessionStore(postgres.url)
    await store.start()
    session_id = unique("outage")
    try:
        await store.create(record(session_id))
        postgres.stop()
        # Connect and statement timeouts answer, not a hang: bounded, with a message.
        with pytest.raises(StoreUnavailableError):
            await asyncio.wait_for(store.acquire_lease(session_id, "replica-a", 30), 30)
        with pytest.raises(StoreUnavailableError):
            await asyncio.wait_for(store.create(record(unique("during-outage"))), 30)
        postgres.start()
        assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
        assert await store.commit_chunk(session_id, "replica-a", 0, [5, 6], time.time())
        loaded = await store.load(session_id)
        assert loaded is not None and loaded[1] == [5, 6]
    finally:
        if not postgres.running():
            postgres.start()
        await store.close()


@needs_postgres
@pytest.mark.parametrize("ping_idle", [True, False], ids=["ping-idle", "negative-control-no-ping"])
async def test_a_postgres_restart_while_the_pool_is_idle_is_not_seen(
    postgres: PostgresServer, ping_idle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL restarted while the store's pooled connections sat idle: the next lease
    and commit succeed, because a connection idle longer than IDLE_PING_S is pinged at
    checkout and replaced when dead (a ping on every checkout would cost a round trip a
    transaction). Negative control: with the idle ping off, the first transaction after
    the restart gets a dead connection and fails."""
    if not ping_idle:
        monkeypatch.setattr("app.store.runners.IDLE_PING_S", float("inf"))
    store = SQLSessionStore(postgres.url)
    await store.start()
    session_id = unique("idle-restart")
    try:
        await store.create(record(session_id))
        assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
        postgres.stop()
        postgres.start()
        await asyncio.sleep(1.2)  # past IDLE_PING_S (1 s)

        async def lease_and_commit() -> None:
            assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
            assert await store.commit_chunk(session_id, "replica-a", 0, [5, 6], time.time())

        if ping_idle:
            await lease_and_commit()
        else:
            with pytest.raises(StoreUnavailableError):
                await lease_and_commit()
    finally:
        if not postgres.running():
            postgres.start()
        await store.close()


async def test_a_full_sqlite_disk_fails_the_commit_whole_and_the_store_recovers(tmp_path: Path) -> None:
    """The store's disk full, as SQLite sees it: ``PRAGMA max_page_count`` caps the
    database so a write that needs a new page fails with SQLITE_FULL ("database or
    disk is full"), the error a full file system gives. The failed commit raises
    StoreUnavailableError and leaves the session exactly as it was (the service then
    undoes the chunk: tests/server/test_store_failure.py); with room again, it commits."""

    store = SQLSessionStore(f"sqlite:///{tmp_path / 'full' / 'sessions.db'}")
    await store.start()
    assert isinstance(store._runner, SQLiteRunner)
    engine = store._runner.engine
    cap = {"pages": 0}

    def cap_pages(dbapi_connection: Any, _record: Any) -> None:
        if cap["pages"]:
            dbapi_connection.cursor().execute(f"PRAGMA max_page_count={cap['pages']}")

    sa.event.listen(engine, "connect", cap_pages)
    try:
        session_id = unique("full")
        await store.create(record(session_id))
        assert isinstance(await store.acquire_lease(session_id, "replica-a", 30), SessionRecord)
        cap["pages"] = int(await store._run(lambda conn: conn.execute(sa.text("PRAGMA page_count")).scalar_one()))
        engine.dispose()  # new connections get the cap: the disk is now full
        with pytest.raises(StoreUnavailableError, match="full"):
            await store.commit_chunk(session_id, "replica-a", 0, list(range(50_000)), time.time())
        loaded = await store.load(session_id)
        assert loaded is not None and loaded[0].num_chunks == 0 and loaded[1] == []
        cap["pages"] = 0
        engine.dispose()  # room again
        assert await store.commit_chunk(session_id, "replica-a", 0, [5, 6], time.time())
        loaded = await store.load(session_id)
        assert loaded is not None and loaded[0].num_chunks == 1 and loaded[1] == [5, 6]
    finally:
        await store.close()


async def test_commits_are_durable_on_the_stores_own_connections(store: SQLSessionStore) -> None:
    """What decides whether a committed chunk survives a power loss, read back from the
    store's live connections (a power loss cannot be produced here; a SIGKILL, which
    the durable-restart test uses, is survived by SQLite's OFF mode too, through the
    OS page cache, so only the setting in force tells FULL from OFF)."""
    if store.dialect == "sqlite":
        assert await store.durability() == {"journal_mode": "wal", "synchronous": "full"}
    else:
        # fsync is the database server's own setting, off on the test server (tests only);
        # synchronous_commit is what a client's session could weaken, and must not.
        assert await store.durability() == {"fsync": "off", "synchronous_commit": "on"}


async def test_only_lease_writes_skip_the_flush(store: SQLSessionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease's commit returns before it is on disk (a lost lease is refused at the
    holder's commit, and a lost holder needs none); a chunk's commit, a session's row and
    objects wait for it. Oracle: the setting in force on the transaction's own connection,
    and which transactions each store call opens."""
    query = "PRAGMA synchronous" if store.dialect == "sqlite" else "SHOW synchronous_commit"
    modes = {}
    for synced in (False, True):
        mode = await store._run(lambda conn: conn.execute(sa.text(query)).scalar_one(), synced=synced)
        modes[synced] = str(mode).lower()
    assert modes == ({False: "1", True: "2"} if store.dialect == "sqlite" else {False: "off", True: "on"})

    opened: list[bool] = []
    run = store._run

    def recording(transaction: Any, write: bool = True, synced: bool = True, one_statement: bool = False) -> Any:
        opened.append(synced)
        return run(transaction, write=write, synced=synced, one_statement=one_statement)

    monkeypatch.setattr(store, "_run", recording)
    session_id = unique("lease-sync")
    await store.create(record(session_id))
    assert opened == [True]
    assert not isinstance(await store.acquire_lease(session_id, "a", 30.0), LeaseRefused)
    assert await store.renew_lease(session_id, "a", 30.0)
    await store.release_lease(session_id, "a")
    assert opened[1:] == [False, False, False]
    assert not isinstance(await store.acquire_lease(session_id, "a", 30.0), LeaseRefused)
    assert await store.commit_chunk(session_id, "a", 0, [1, 2, 3], time.time())
    assert opened[-1] is True
    assert (await store.durability())["synchronous" if store.dialect == "sqlite" else "synchronous_commit"] in (
        "full",
        "on",
    )


async def test_negative_control_sqlite_without_synchronous_full_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def relaxed(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.cursor().execute("PRAGMA synchronous=OFF")

    monkeypatch.setattr("app.store.runners._sqlite_pragmas", relaxed)
    store = SQLSessionStore(f"sqlite:///{tmp_path / 'relaxed' / 'sessions.db'}")
    await store.start()
    try:
        assert (await store.durability())["synchronous"] == "off"
    finally:
        await store.close()


async def test_objects_written_together_are_all_kept_or_none(store: SQLSessionStore) -> None:
    """A response and the items it adds to its conversation are one write: one object
    that cannot be written (here, data JSON cannot hold) leaves none of them, and the
    store goes on. (Before, each object was its own transaction: the first was kept.)"""
    from app.store import StoredObject

    session_id, now = unique("objects"), time.time()
    await store.create(record(session_id))
    first = StoredObject(unique("resp"), "response", "alice", session_id, 0, now, {"ok": 1})
    bad = StoredObject(unique("item"), "item", "alice", session_id, 1, now, {"not json": object()})
    with pytest.raises(TypeError):
        await store.put_objects([first, bad])
    assert await store.get_object("response", first.id) is None
    good = StoredObject(unique("item"), "item", "alice", session_id, 1, now, {"ok": 2})
    await store.put_objects([first, good])
    assert (await store.get_object("response", first.id)) is not None
    assert [o.id for o in await store.list_objects("item", session_id)] == [good.id]
