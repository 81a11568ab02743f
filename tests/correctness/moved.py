"""The harness's moved-replica configuration: every session's chunks alternate between
two replicas that share one PostgreSQL store and one disk-tier directory
(``disk_tier_shared``), so every chunk after the first runs on the replica that did not
run the one before, and resumes from what the other wrote: its transcript from the
store, its KV from the shared tier where the other's files have landed (a miss
otherwise, recomputed).

Real server processes (embedded tiny model, float32, ``python -m app.main``), driven
over HTTP. Oracle: ``run_workload``'s, each chunk's answer token for token against a
salted recompute (``/v1/completions`` with a fresh ``cache_salt``: no cache of either
replica can serve it), mismatches measured for their top-2 margin. The report adds what
the moves read from disk: a run whose moved chunks never hit the shared tier would
match its oracle trivially, so a pass needs disk hits on moved chunks.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.correctness.harness import (
    SESSION_TOKENS,
    Generation,
    HttpBackend,
    Report,
    make_workload,
    run_workload,
)

API_KEY = "harness-moved-key"
MODEL = "embedded-tiny"
# The share of moved chunks that must read some of their context from the shared tier.
# Below 1: a move right after a chunk may come before the other replica's files land.
MIN_MOVED_DISK_SHARE = 0.5


def replica_settings(name: str, store_url: str, tier: Path) -> dict[str, str]:
    return {
        "api_keys": API_KEY,
        "replica_name": name,
        "replica_id": name,
        "store_url": store_url,
        "cache_salt_secret": "harness-moved-secret",
        "dtype": "float32",
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "16",
        "max_sessions": "256",
        "max_model_len": "1024",
        "session_park_after_s": "3600",
        "session_idle_timeout_s": "3600",
        "log_level": "warning",
        "disk_tier_gib": "1",
        "disk_tier_dir": str(tier),
        "disk_tier_shared": "true",
    }


@dataclass
class Moves:
    moved_chunks: int = 0  # chunks run on the other replica than the chunk before
    moved_from_disk: int = 0  # of those, with disk-tier tokens
    disk_tier_tokens: int = 0
    computed_tokens: int = 0


class MovingBackend:
    """``run_workload``'s backend over two replicas: a session's chunks alternate between
    them; everything else (recomputes, probes, margins) runs on the first."""

    def __init__(self, urls: tuple[str, str]) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        self._replicas = [httpx.AsyncClient(base_url=url, headers=headers, timeout=300) for url in urls]
        self._probes = HttpBackend(urls[0], API_KEY, MODEL)
        self._turns: dict[str, int] = {}
        self.moves = Moves()

    def _serving(self, session_id: str) -> httpx.AsyncClient:
        return self._replicas[(self._turns[session_id] - 1) % 2]

    async def open_session(self) -> str:
        created = await self._replicas[0].post(
            "/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}}
        )
        created.raise_for_status()
        session_id = str(created.json()["id"])
        self._turns[session_id] = 0
        return session_id

    async def session_chunk(self, session_id: str, token_ids: list[int], max_tokens: int) -> list[int]:
        turn = self._turns[session_id]
        self._turns[session_id] = turn + 1
        answer = await self._replicas[turn % 2].post(
            f"/v1/sessions/{session_id}/chunks", json={"input": token_ids, "max_tokens": max_tokens}
        )
        answer.raise_for_status()
        body = answer.json()
        if turn > 0:
            details = body["usage"]["prompt_tokens_details"]
            self.moves.moved_chunks += 1
            self.moves.moved_from_disk += details["disk_tier_tokens"] > 0
            self.moves.disk_tier_tokens += details["disk_tier_tokens"]
            self.moves.computed_tokens += details["computed_tokens"]
        return list(body["output"]["token_ids"])

    async def close_session(self, session_id: str) -> None:
        (await self._serving(session_id).delete(f"/v1/sessions/{session_id}")).raise_for_status()

    async def park_session(self, session_id: str) -> None:
        (await self._serving(session_id).post(f"/v1/sessions/{session_id}/park")).raise_for_status()

    async def generate(self, prompt_ids: list[int], max_tokens: int, recompute: bool) -> Generation:
        return await self._probes.generate(prompt_ids, max_tokens, recompute)

    async def top2_margin(self, prompt_ids: list[int]) -> float:
        return await self._probes.top2_margin(prompt_ids)

    async def reset_device_cache(self) -> bool:
        answers = [await replica.post("/v1/admin/reset_device_cache") for replica in self._replicas]
        return all(answer.status_code == 200 for answer in answers)

    async def leftover_requests(self) -> list[str]:
        return await self._probes.leftover_requests()

    async def preempt_running(self) -> None:
        return

    async def engine_counter(self, name: str) -> float:
        return await self._probes.engine_counter(name)

    async def aclose(self) -> None:
        for replica in self._replicas:
            await replica.aclose()
        await self._probes.aclose()


@contextlib.contextmanager
def two_replicas(workdir: Path) -> Iterator[tuple[str, str]]:
    """Two replicas on a fresh PostgreSQL database and one shared tier directory."""
    from tests.harness.postgres import postgres_server
    from tests.harness.servers import app_server, enter_together

    with contextlib.ExitStack() as stack:
        store_url = stack.enter_context(postgres_server()).url
        tier = workdir / "shared-tier"
        servers = enter_together(
            stack,
            [
                app_server(name, workdir / f"{name}.log", replica_settings(name, store_url, tier))
                for name in ("harness-replica-a", "harness-replica-b")
            ],
        )
        yield servers[0].base_url, servers[1].base_url


async def run_moved_on(urls: tuple[str, str], seed: int, num_sessions: int) -> tuple[Report, Moves]:
    backend = MovingBackend(urls)
    try:
        workload = make_workload(
            seed, num_sessions, block_size=32, blocks_per_chunk=1, max_session_tokens=SESSION_TOKENS
        )
        report = await run_workload(backend, workload)
    finally:
        await backend.aclose()
    return report, backend.moves


def moved_passed(report: Report, moves: Moves) -> bool:
    return (
        report.passed and moves.moved_chunks > 0 and moves.moved_from_disk >= MIN_MOVED_DISK_SHARE * moves.moved_chunks
    )


async def run_moved(seed: int, num_sessions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="streamsess-moved-") as workdir, two_replicas(Path(workdir)) as urls:
        report, moves = await run_moved_on(urls, seed, num_sessions)
    return {**report.summary(), "moves": vars(moves), "passed": moved_passed(report, moves)}
