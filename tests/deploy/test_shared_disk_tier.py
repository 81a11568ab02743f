"""A lost replica costs a disk read, not a recompute: two replicas on one PostgreSQL
store and one shared disk-tier directory (``disk_tier_shared``). A session served on
replica A goes on on replica B after A stops (SIGTERM: it drains, parks its sessions and
flushes the tier) and after A is killed (``kill -9``: what was written by then), and B
loads the session's context from the files A wrote.

Real server processes (embedded tiny model, float32). Oracle: a control session on B,
under another API key (so another cache salt: nothing of the moved session's cache is
visible to it, a salted recompute), runs the same chunks uninterrupted; float32 makes
the moved session's answer comparable with it token for token. B never computed the
moved session's blocks, so a disk hit can only be a file A wrote (counted as B's
``foreign_hits``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness.servers import RunningServer, app_server, enter_together, free_port
from tests.postgres import needs_postgres, postgres_server

pytestmark = [pytest.mark.server, needs_postgres]

KEYS = ("shared-tier-key", "control-key")
BLOCK = 32  # the servers' block size (the default)
MAX_TOKENS = 6


def settings(name: str, store_url: str, tier: Path) -> dict[str, str]:
    return {
        "api_keys": ",".join(KEYS),
        "replica_name": name,
        "replica_id": name,
        "store_url": store_url,
        "cache_salt_secret": "one-secret-for-every-replica",
        "dtype": "float32",
        "kv_cache_gib": "0.25",
        "cpu_tier_gib": "0.5",
        "max_num_seqs": "8",
        "log_level": "warning",
        "session_park_after_s": "600",
        "disk_tier_gib": "1",
        "disk_tier_dir": str(tier),
        "disk_tier_shared": "true",
    }


def client(server: RunningServer, key: str = KEYS[0]) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def chunks(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 700) for _ in range(100)] for _ in range(3)]


def open_session(http: httpx.Client) -> str:
    created = http.post("/v1/sessions", json={"defaults": {"temperature": 0, "ignore_eos": True}})
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def send(http: httpx.Client, session_id: str, chunk: list[int]) -> dict[str, Any]:
    answer = http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": MAX_TOKENS})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def context_of(http: httpx.Client, session_id: str) -> int:
    return int(http.get(f"/v1/sessions/{session_id}").json()["num_tokens"])


def files_settled(tier: Path, at_least: int, timeout_s: float = 30) -> int:
    """Wait until the tier holds ``at_least`` files and no more are being written."""
    deadline, last = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        count = sum(1 for _ in tier.rglob("*.bin"))
        if count >= at_least and count == last:
            return count
        last = count
        time.sleep(0.5)
    raise AssertionError(f"{last} files in the shared tier, {at_least} wanted")


def foreign_hits(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:kv_offload_disk_tier_foreign_hits")
    )


@contextlib.contextmanager
def replica(name: str, store_url: str, tier: Path, port: int, log_dir: Path) -> Iterator[RunningServer]:
    with app_server(name, log_dir / f"{name}.log", settings(name, store_url, tier), port=port) as server:
        yield server


def test_a_moved_session_resumes_from_the_files_another_replica_wrote(tmp_path: Path) -> None:
    tier = tmp_path / "shared-tier"
    port_a, port_b = free_port(), free_port()
    with contextlib.ExitStack() as stack:
        store_url = stack.enter_context(postgres_server()).url
        a, b = enter_together(
            stack,
            [
                replica("replica-a", store_url, tier, port_a, tmp_path),
                replica("replica-b", store_url, tier, port_b, tmp_path),
            ],
        )
        http_b = stack.enter_context(client(b))
        control_b = stack.enter_context(client(b, KEYS[1]))
        inputs = {"drained": chunks(1), "killed": chunks(2)}
        expected = {}
        for name, session_chunks in inputs.items():
            control = open_session(control_b)
            expected[name] = [send(control_b, control, chunk)["output"]["token_ids"] for chunk in session_chunks]
        hits_before = foreign_hits(http_b)

        # 1. A drains (SIGTERM): its sessions are parked, the tier flushed, before it exits.
        with client(a) as http_a:
            drained = open_session(http_a)
            for chunk in inputs["drained"][:2]:
                send(http_a, drained, chunk)
        a.process.send_signal(signal.SIGTERM)
        assert a.process.wait(timeout=90) in (0, -signal.SIGTERM)
        context = context_of(http_b, drained)
        moved = send(http_b, drained, inputs["drained"][2])
        details = moved["usage"]["prompt_tokens_details"]
        print("after a drain:", details, "context", context)
        assert moved["output"]["token_ids"] == expected["drained"][2]
        # Every token with KV (all but the last sampled) comes from the files A wrote.
        assert details["disk_tier_tokens"] == (context - 1) // BLOCK * BLOCK, details
        assert details["device_tokens"] == details["cpu_tier_tokens"] == 0, details
        assert foreign_hits(http_b) > hits_before

        # 2. A again, then killed (kill -9) once its parked session's files are written.
        with replica("replica-a", store_url, tier, port_a, tmp_path) as a_again, client(a_again) as http_a:
            killed = open_session(http_a)
            for chunk in inputs["killed"][:2]:
                send(http_a, killed, chunk)
            assert http_a.post(f"/v1/sessions/{killed}/park").status_code == 200
            context = context_of(http_a, killed)
            files_settled(tier, context // BLOCK)
            os.killpg(a_again.process.pid, signal.SIGKILL)
            a_again.process.wait(timeout=30)
        moved = send(http_b, killed, inputs["killed"][2])
        details = moved["usage"]["prompt_tokens_details"]
        print("after kill -9:", details, "context", context)
        assert moved["output"]["token_ids"] == expected["killed"][2]
        assert details["disk_tier_tokens"] >= context // BLOCK * BLOCK - BLOCK, details  # most of it
        assert details["device_tokens"] == details["cpu_tier_tokens"] == 0, details


async def test_the_harness_with_chunks_alternating_between_two_replicas(tmp_path: Path) -> None:
    """The correctness harness's moved-replica configuration, small (the recorded run has
    200 sessions: docs/correctness.md): every chunk after a session's first runs on the
    other replica, each answer against a salted recompute (float32)."""
    from tests.correctness.moved import moved_passed, run_moved_on, two_replicas

    with two_replicas(tmp_path) as urls:
        report, moves = await run_moved_on(urls, seed=20261207, num_sessions=12)
    summary = report.summary()
    print("moved-replica harness:", {k: summary[k] for k in ("sessions", "chunks_checked", "mismatches")}, moves)
    assert report.sessions == 12 and report.passed, summary
    assert moves.moved_chunks > 0 and moved_passed(report, moves), moves
