"""The scale profile's proxy, for real: Debian's nginx on loopback, with the repo's
own nginx template, in front of two app replicas (embedded model, real engines).

Every chunk of every session (REST and websocket) must land on the replica that
created the session; stopping one replica must fail only its own sessions, with
clear errors, while the other replica's sessions go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import websockets

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "docker" / "nginx" / "streamsess.conf.template"
KEY = "affinity-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        shutil.which("nginx") is None,
        reason="nginx (Debian package nginx-light) is not installed; scripts/test installs it when run as root",
    ),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Replica:
    name: str
    port: int
    process: subprocess.Popen[bytes]


def start_replica(name: str, log_dir: Path) -> Replica:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STREAMSESS_")},
        "STREAMSESS_API_KEYS": KEY,
        "STREAMSESS_REPLICA_NAME": name,
        "STREAMSESS_PORT": str(port),
        "STREAMSESS_KV_CACHE_GIB": "0.25",
        "STREAMSESS_CPU_TIER_GIB": "0.5",
        "STREAMSESS_MAX_NUM_SEQS": "16",
        "STREAMSESS_MAX_SESSIONS": "16",
        "STREAMSESS_LOG_LEVEL": "warning",
    }
    log = (log_dir / f"{name}.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "app.main"], cwd=REPO, env=env, stdout=log, stderr=log)
    return Replica(name, port, process)


def wait_healthy(replica: Replica, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            raise RuntimeError(f"replica {replica.name} exited with {replica.process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{replica.port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"replica {replica.name} did not become healthy")


def render_nginx(replicas: list[Replica], port: int, workdir: Path) -> Path:
    """The template as the nginx image's envsubst renders it, in a minimal main config."""
    upstreams = " ".join(f"server 127.0.0.1:{r.port} max_fails=1 fail_timeout=10s;" for r in replicas)
    site = TEMPLATE.read_text()
    site = site.replace("${STREAMSESS_UPSTREAM_SERVERS}", upstreams).replace("${STREAMSESS_PROXY_PORT}", f"127.0.0.1:{port}")
    (workdir / "streamsess.conf").write_text(site)
    temp = workdir / "temp"
    temp.mkdir(mode=0o777)
    temp.chmod(0o777)  # nginx workers run as an unprivileged user
    main = workdir / "nginx.conf"
    main.write_text(
        f"""daemon off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    include {workdir}/streamsess.conf;
}}
"""
    )
    return main


@dataclass
class Cluster:
    proxy: str
    replicas: dict[str, Replica]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("affinity")
    replicas = [start_replica(name, workdir) for name in ("replica-a", "replica-b")]
    nginx: subprocess.Popen[bytes] | None = None
    try:
        for replica in replicas:
            wait_healthy(replica)
        port = free_port()
        config = render_nginx(replicas, port, workdir)
        check = subprocess.run(["nginx", "-t", "-c", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        nginx = subprocess.Popen(["nginx", "-c", str(config)], stderr=subprocess.PIPE)
        proxy = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{proxy}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield Cluster(proxy, {r.name: r for r in replicas})
    finally:
        for process in [nginx, *(r.process for r in replicas)]:
            if process is not None and process.poll() is None:
                process.terminate()
        for process in [nginx, *(r.process for r in replicas)]:
            if process is not None:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


@pytest_asyncio.fixture
async def http(cluster: Cluster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=cluster.proxy, headers=HEADERS, timeout=120) as client:
        yield client


# Sessions opened by the first test; the failover test closes the book on them.
SESSIONS: dict[str, str] = {}


async def test_rest_chunks_land_on_the_creating_replica(http: httpx.AsyncClient) -> None:
    for index in range(12):
        headers = {"X-Session-ID": f"client-chosen-{index}"} if index % 3 == 0 else {}
        created = await http.post("/v1/sessions", json={"defaults": {"temperature": 0}}, headers=headers)
        assert created.status_code == 201, created.text
        session_id, home = created.json()["id"], created.headers["x-replica"]
        if headers:
            assert session_id == headers["X-Session-ID"]
        for chunk in ([1, 2, 3], "and more", [4, 5]):
            response = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": chunk, "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.headers["x-replica"] == home
        state = await http.get(f"/v1/sessions/{session_id}")
        assert state.headers["x-replica"] == home and state.json()["num_chunks"] == 3
        SESSIONS[session_id] = home
    # Both replicas hold sessions: the hash spreads them.
    assert set(SESSIONS.values()) == {"replica-a", "replica-b"}
    # Requests that name no session reach a replica too.
    completion = await http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1, 2], "max_tokens": 2})
    assert completion.status_code == 200


async def test_websocket_sessions_are_routed_by_their_id(cluster: Cluster, http: httpx.AsyncClient) -> None:
    ws_base = cluster.proxy.replace("http://", "ws://")
    for _ in range(6):
        async with websockets.connect(f"{ws_base}/v1/sessions/ws", additional_headers=HEADERS) as ws:
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            session_id = created["session"]["id"]
            await ws.send(json.dumps({"type": "input.append", "input": [7, 8, 9], "max_tokens": 2}))
            while (event := json.loads(await ws.recv()))["type"] != "response.done":
                assert event["type"] == "response.output.delta", event
            # The session id the proxy chose routes REST calls to the same replica,
            # which knows the session (a wrong replica would answer 404).
            state = await http.get(f"/v1/sessions/{session_id}")
            assert state.status_code == 200 and state.json()["num_chunks"] == 1
            # A second connection, attached by id, lands there too.
            async with websockets.connect(f"{ws_base}/v1/sessions/{session_id}/ws", additional_headers=HEADERS) as again:
                hello = json.loads(await again.recv())
                assert hello["type"] == "session.updated" and hello["session"]["num_chunks"] == 1
                await again.send(json.dumps({"type": "input.append", "input": [1], "max_tokens": 1}))
                while (event := json.loads(await again.recv()))["type"] != "response.done":
                    pass
            assert (await http.get(f"/v1/sessions/{session_id}")).json()["num_chunks"] == 2
            await ws.send(json.dumps({"type": "session.close"}))


async def test_stopping_a_replica_fails_only_its_sessions(cluster: Cluster, http: httpx.AsyncClient) -> None:
    assert SESSIONS, "runs after test_rest_chunks_land_on_the_creating_replica"
    victim = cluster.replicas["replica-a"]
    victim.process.terminate()
    await asyncio.to_thread(victim.process.wait, 60)
    lost_codes = set()
    for session_id, home in SESSIONS.items():
        response = await http.post(f"/v1/sessions/{session_id}/chunks", json={"input": [3, 4], "max_tokens": 2})
        if home == "replica-a":
            # Lost with its replica. The proxy answers 503 replica_unavailable until it
            # takes the replica out of the ring; then the replica that took over that
            # share of ids answers 404 session_not_found. Both in the OpenAI shape.
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (response.status_code, error["code"]) in {(503, "replica_unavailable"), (404, "session_not_found")}
            lost_codes.add(error["code"])
        else:
            assert response.status_code == 200, response.text
            assert response.headers["x-replica"] == "replica-b"
    assert "replica_unavailable" in lost_codes  # the first request after the stop says so
    # New sessions and stateless requests go on, on the healthy replica.
    for _ in range(4):
        created = await http.post("/v1/sessions")
        assert created.status_code == 201 and created.headers["x-replica"] == "replica-b"
        chunk = await http.post(f"/v1/sessions/{created.json()['id']}/chunks", json={"input": [1], "max_tokens": 1})
        assert chunk.status_code == 200 and chunk.headers["x-replica"] == "replica-b"
    completion = await http.post("/v1/completions", json={"model": "embedded-tiny", "prompt": [1, 2], "max_tokens": 2})
    assert completion.status_code == 200 and completion.headers["x-replica"] == "replica-b"
