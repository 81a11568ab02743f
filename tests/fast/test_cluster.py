"""Replicas that share a store refuse to start beside each other when they would break
it (app/store/cluster.py), on a fake engine and a real SQLite store shared by two services in
one process. Oracle: the service's start raising ``ReplicaConflict`` or not, and the
salts the two compute."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.cache_salt import cache_salter
from app.metrics import session_metrics
from app.sessions.service import SessionService
from app.settings import Settings
from app.store import cluster, open_store
from app.store.cluster import ReplicaConflict
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def replica(tmp_path: Path, state: str, **settings: Any) -> AsyncIterator[SessionService]:
    """A service on the store ``tmp_path/shared.db`` with its own state directory."""
    engine = FakeEngine()
    config = Settings(
        _env_file=None,
        state_dir=str(tmp_path / state),
        api_keys="k",
        store_url=f"sqlite:///{tmp_path / 'shared.db'}",
        **settings,
    )
    service = SessionService(
        engine,
        config,
        "fake",
        engine.get_tokenizer(),
        session_metrics(),
        store=open_store(config),
        salter=cache_salter(config),
    )
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture(autouse=True)
def short_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster, "REPLICA_TTL_S", 0.3)


async def test_a_second_live_replica_with_the_same_id_is_refused(tmp_path: Path) -> None:
    async with replica(tmp_path, "a", replica_id="same"):
        with pytest.raises(ReplicaConflict, match="STREAMSESS_REPLICA_ID"):
            async with replica(tmp_path, "b", replica_id="same"):
                pass
        async with replica(tmp_path, "c", replica_id="other"):
            pass  # another id is welcome


async def test_the_same_replica_restarted_holds_its_id_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its instance token is in its state directory: a restart after a kill (no leave,
    the row still fresh) is not a conflict, and does not wait (with a heartbeat TTL of
    60 s, a wait would outlast the test's timeout)."""
    monkeypatch.setattr(cluster, "REPLICA_TTL_S", 60.0)
    async with replica(tmp_path, "a", replica_id="same") as first:
        first.membership.leave = _nothing  # type: ignore[method-assign]  # as if killed
    async with replica(tmp_path, "a", replica_id="same"):
        pass


async def test_a_stopped_replicas_id_is_free_at_once_and_a_dead_ones_after_its_heartbeat(tmp_path: Path) -> None:
    async with replica(tmp_path, "a", replica_id="same"):
        pass
    async with replica(tmp_path, "b", replica_id="same") as second:
        second.membership.leave = _nothing  # type: ignore[method-assign]  # killed: no leave
        second.membership.beat = _nothing  # type: ignore[method-assign]
    async with replica(tmp_path, "c", replica_id="same"):  # waits out b's heartbeat, then holds it
        pass


async def test_replicas_adopt_the_clusters_cache_salt_secret(tmp_path: Path) -> None:
    async with replica(tmp_path, "a", replica_id="a") as first, replica(tmp_path, "b", replica_id="b") as second:
        assert first.cache_salt("key_x") == second.cache_salt("key_x")
    # Negative control: each state directory made its own secret; without the store's they differ.
    assert (
        cache_salter(Settings(_env_file=None, state_dir=str(tmp_path / "a"), api_keys="k")).salt("key_x")  # type: ignore[union-attr]
        != cache_salter(Settings(_env_file=None, state_dir=str(tmp_path / "b"), api_keys="k")).salt("key_x")
    )  # type: ignore[union-attr]


async def test_a_replica_configured_with_another_secret_is_refused(tmp_path: Path) -> None:
    async with replica(tmp_path, "a", replica_id="a", cache_salt_secret="one"):
        with pytest.raises(ReplicaConflict, match="CACHE_SALT_SECRET"):
            async with replica(tmp_path, "b", replica_id="b", cache_salt_secret="two"):
                pass
        async with replica(tmp_path, "c", replica_id="c", cache_salt_secret="one"):
            pass


async def test_a_replica_that_must_share_its_store_refuses_sqlite(tmp_path: Path) -> None:
    with pytest.raises(ReplicaConflict, match="STREAMSESS_STORE_URL"):
        async with replica(tmp_path, "a", shared_store_required=True):
            pass


async def _nothing() -> None:
    return None
