"""compose's ``scale`` and ``metrics`` profiles, for real: HAProxy in front of two
replicas of the CPU image sharing PostgreSQL, Prometheus scraping both. Through the
proxy's published port only: a Responses chain stays on one replica (routed by its
key), a session goes on after the replica holding it is stopped, and so does the chain.

Oracle: the replica that answered (each response's ``x-replica`` header, the
replica's compose service name), the session's transcript, and Prometheus's own
``up`` series for both replicas."""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request

import httpx
import openai

from tests.containers.compose import API_KEY, ROOT, Compose, free_port, render
from tests.containers.podman import Podman

REPLICAS = ("server", "replica-2")
# The profiles' services but Grafana: it has no image a registry here gives and no Debian
# package (its dashboard is checked on a real Prometheus in tests/deploy/test_dashboard.py).
SERVICES = (*REPLICAS, "postgres", "proxy", "prometheus")


def prometheus_query(port: int, query: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as answer:
        return list(json.load(answer)["data"]["result"])


def test_scale_profile_routes_by_key_and_survives_a_stopped_replica(
    podman: Podman, cpu_image: str, standin_images: dict[str, str]
) -> None:
    file = ROOT / "docker" / f".compose-check-scale-{os.getpid()}.yaml"
    render(file, {"streaming-sessions:cpu": cpu_image, **standin_images})
    proxy_port, prometheus_port = free_port(), free_port()
    env = {
        "STREAMSESS_PORT": str(free_port()),
        "STREAMSESS_PROXY_PUBLISH_PORT": str(proxy_port),
        "STREAMSESS_PROMETHEUS_PORT": str(prometheus_port),
        "STREAMSESS_STORE_URL": "postgresql://streamsess:streamsess@postgres:5432/streamsess",
    }
    try:
        with Compose(podman, file, f"streamsess-check-scale-{os.getpid()}", env) as compose:
            started = time.monotonic()
            compose("--profile", "scale", "--profile", "metrics", "up", "-d", *SERVICES)
            compose.wait_healthy([*REPLICAS, "postgres", "proxy"])
            print(f"\nscale profile healthy {time.monotonic() - started:.0f} s after compose up")
            run_through_proxy(compose, proxy_port, prometheus_port)
    finally:
        file.unlink(missing_ok=True)


def run_through_proxy(compose: Compose, proxy_port: int, prometheus_port: int) -> None:
    base = f"http://127.0.0.1:{proxy_port}"
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY)
    model = sdk.models.list().data[0].id

    def respond(text: str, previous: str | None) -> tuple[str, str]:
        raw = sdk.responses.with_raw_response.create(
            model=model, input=text, max_output_tokens=4, temperature=0, previous_response_id=previous
        )
        return raw.parse().id, raw.headers["x-replica"]

    chain: list[tuple[str, str]] = []
    for text in ("Remember the number seven.", "And the colour blue.", "And the city Lisbon."):
        chain.append(respond(text, chain[-1][0] if chain else None))
    assert {replica for _, replica in chain} <= set(REPLICAS)
    assert len({replica for _, replica in chain}) == 1, f"a chain changed replica: {chain}"

    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 4, "temperature": 0}}).json()["id"]
        first = http.post(f"/v1/sessions/{session}/chunks", json={"input": "The first chunk. "})
        assert first.status_code == 200, first.text
        holder = first.headers["x-replica"]

        # Prometheus scrapes both replicas (every 15 s: wait for two scrapes at most).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            up = prometheus_query(prometheus_port, 'up{job="streaming-sessions"} == 1')
            if len(up) == 2:
                break
            time.sleep(3)
        assert len(up) == 2, f"Prometheus does not see both replicas up: {up}"
        assert prometheus_query(prometheus_port, "streamsess_sessions_open"), "no session metric scraped"

        compose("stop", "-t", "60", holder)  # a stop drains: the session is parked, its lease released
        second = http.post(f"/v1/sessions/{session}/chunks", json={"input": "The second chunk. "})
        assert second.status_code == 200, second.text
        assert second.headers["x-replica"] != holder
        transcript = http.get(f"/v1/sessions/{session}/transcript").json()["text"]
        assert "The first chunk." in transcript and "The second chunk." in transcript

    _, replica = respond("And the animal fox.", chain[-1][0])  # the chain goes on, wherever it was
    assert replica in REPLICAS and replica != holder
