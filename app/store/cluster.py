"""This replica among the replicas that share a store: refused at start when it would
break the others, and kept in the store's list of live replicas while it runs.

At start (``join``), a replica refuses, with a message that names the fix:
- to share an id with a live replica (two processes extending each other's sessions
  under one lease holder would not exclude each other). A replica's instance is a token
  kept in its state directory, so the same replica restarted, even after ``kill -9``,
  holds its id again at once; another instance waits out the holder's heartbeat
  (``REPLICA_TTL_S``) before it is refused, so a replica moved to a new disk restarts;
- to run on a store no other replica can reach when ``shared_store_required`` says it
  is one of several (compose's scale profile and the Kubernetes manifests set it):
  replicas on their own SQLite files answer 404 for each other's sessions;
- to use another cache-salt secret than the cluster's: the first replica's secret is
  kept in the store and every later one adopts it (salts, so prefix-cache and tier
  names, agree across replicas); one configured with another secret is refused;
- to share a disk tier (``disk_tier_shared``) whose namespace marker says replicas with
  other cache salts wrote it: their files' names could never match this one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path

from app.cache_salt import CacheSalter
from app.settings import Settings
from app.store import SessionStore, StoreUnavailableError

logger = logging.getLogger(__name__)

INSTANCE_FILE = "replica_instance"
# A replica whose heartbeat is older than this is gone; heartbeats come every third of it.
REPLICA_TTL_S = 15.0
SALT_SECRET = "cache_salt_secret"
NAMESPACE_FILE = "streamsess-namespace.json"
NAMESPACE_PROBE = "streamsess-disk-tier-namespace"  # salted into the marker's digest


class ReplicaConflict(RuntimeError):
    """This replica must not start beside the others: the message says why and the fix."""


def instance_token(state_dir: str) -> str:
    path = Path(state_dir) / INSTANCE_FILE
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    path.write_text(token)
    return token


def check_disk_tier_namespace(directory: str, salter: CacheSalter | None) -> None:
    """A shared disk tier's marker names the cache salts its files were written under (a
    digest, never the secret): the first replica writes it, every later one must match."""
    salts = "shared" if salter is None else hashlib.sha256(salter.salt(NAMESPACE_PROBE).encode()).hexdigest()[:16]
    marker = Path(directory) / NAMESPACE_FILE
    marker.parent.mkdir(parents=True, exist_ok=True)
    draft = marker.with_name(f"{NAMESPACE_FILE}.{secrets.token_hex(4)}.tmp")
    draft.write_text(json.dumps({"cache_salts": salts}))
    with contextlib.suppress(FileExistsError):
        os.link(draft, marker)  # whole or not there: a replica starting beside never reads half
    draft.unlink()
    written = json.loads(marker.read_text()).get("cache_salts")
    if written != salts:
        raise ReplicaConflict(
            f"the shared disk tier {directory} was written by replicas with other cache salts (another "
            "STREAMSESS_CACHE_SALT_SECRET, or another STREAMSESS_CACHE_ISOLATION): set the same on every "
            "replica sharing it, or give this one a STREAMSESS_DISK_TIER_DIR of its own."
        )


class ClusterMembership:
    def __init__(self, store: SessionStore, settings: Settings, salter: CacheSalter | None) -> None:
        self._store, self._settings, self._salter = store, settings, salter
        self.replica_id = settings.resolved_replica_id()
        self._instance = instance_token(settings.resolved_state_dir())

    async def join(self) -> None:
        if self._settings.shared_store_required and not self._store.shared:
            raise ReplicaConflict(
                "shared_store_required is set (this server is one of several replicas) but its session "
                "store is not shared: set STREAMSESS_STORE_URL to the replicas' PostgreSQL database "
                "(postgresql://user:password@host/db)."
            )
        age = await self._store.join(self.replica_id, self._instance, REPLICA_TTL_S)
        if age is not None:
            # The holder may be this replica's previous life on another disk: wait out its heartbeat.
            logger.warning(
                "replica id %r was last seen %.1f s ago by another instance; waiting up to %.0f s",
                self.replica_id,
                age,
                REPLICA_TTL_S,
            )
            await asyncio.sleep(max(REPLICA_TTL_S - age, 0) + 0.5)
            age = await self._store.join(self.replica_id, self._instance, REPLICA_TTL_S)
        if age is not None:
            raise ReplicaConflict(
                f"replica id {self.replica_id!r} is held by another live replica sharing this store "
                f"(its heartbeat {age:.1f} s ago): give each replica its own STREAMSESS_REPLICA_ID."
            )
        if self._salter is not None:
            await self._agree_on_salt_secret(self._salter)
        if self._settings.disk_tier_gib and self._settings.disk_tier_shared:
            try:
                check_disk_tier_namespace(self._settings.resolved_disk_tier_dir(), self._salter)
            except ReplicaConflict:
                await self.leave()
                raise

    async def _agree_on_salt_secret(self, salter: CacheSalter) -> None:
        cluster_secret = (await self._store.shared_value(SALT_SECRET, salter.secret.decode())).encode()
        if cluster_secret == salter.secret:
            return
        if self._settings.cache_salt_secret is not None:
            await self.leave()
            raise ReplicaConflict(
                "STREAMSESS_CACHE_SALT_SECRET differs from the secret the other replicas sharing this store "
                "use: set the same secret on every replica, or none (each then adopts the store's)."
            )
        salter.secret = cluster_secret  # this replica's own was made locally: the cluster's wins

    async def beat(self) -> None:
        """Heartbeats while the server runs (a task)."""
        while True:
            await asyncio.sleep(REPLICA_TTL_S / 3)
            with contextlib.suppress(StoreUnavailableError):
                if not await self._store.heartbeat(self.replica_id, self._instance):
                    logger.error("replica id %r was taken over by another instance", self.replica_id)

    async def leave(self) -> None:
        with contextlib.suppress(StoreUnavailableError):
            await self._store.leave(self.replica_id, self._instance)
