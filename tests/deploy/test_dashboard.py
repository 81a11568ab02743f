"""The Grafana dashboard (docker/grafana): Grafana's provisioning shape, and every panel's
query run by a real Prometheus (Debian's, on loopback) scraping a real server (the tiny
model, a disk tier) that has served sessions over REST and SSE, parked and resumed one,
and refused a chunk: each query returns data, so a misnamed metric cannot leave a panel
silently empty. Oracle: Prometheus's own answers to the panels' queries."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.render import DASHBOARD, DASHBOARD_ROWS, dashboard_queries, metric_names
from tests.harness.servers import RunningServer, app_server, free_port, wait_answering

REPO = Path(__file__).resolve().parents[2]
PROVISIONING = REPO / "docker" / "grafana" / "provisioning"
API_KEY = "dashboard-test-key"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def test_dashboard_has_grafanas_provisioning_shape() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    panels = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert len(panels) == sum(len(row_panels) for _, row_panels in DASHBOARD_ROWS)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
        assert all(target["expr"] and target["refId"] for target in panel["targets"])
    assert board["templating"]["list"][0]["type"] == "datasource"
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "streaming-sessions.yaml").read_text())
    assert providers["apiVersion"] == 1 and providers["providers"][0]["options"]["path"]
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["grafana"]
    mounts = {volume.split(":")[1]: volume.split(":")[0] for volume in compose["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert mounts[providers["providers"][0]["options"]["path"]] == "./grafana/dashboards"


@contextlib.contextmanager
def prometheus(target: str, workdir: Path) -> Iterator[str]:
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "streaming-sessions",
                        "metrics_path": "/metrics",
                        "static_configs": [{"targets": [target]}],
                    }
                ],
            }
        )
    )
    log = (workdir / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_answering(process, f"{url}/-/ready", 30, workdir / "prometheus.log", interval_s=0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


# Shown by the dashboard, but their events need what one server cannot give here: another
# replica's files (foreign hits, vanished files) or a corrupt file. Each is checked to be
# a metric the server declares (its HELP line), so a misspelt name still fails.
EVENTS_NOT_SERVED = {
    "vllm:kv_offload_disk_tier_foreign_hits_total",
    "vllm:kv_offload_disk_tier_vanished_total",
    "vllm:kv_offload_disk_tier_checksum_failures_total",
}
LONG_CHUNK = " ".join(f"word{i}" for i in range(120)) + " "  # several whole blocks: offloaded, written to disk


def serve_sessions(server: RunningServer) -> str:
    """What the panels show: sessions over REST and SSE, a park and a resume, refusals."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        session = http.post("/v1/sessions", json={"defaults": {"max_tokens": 4, "temperature": 0}}).json()["id"]
        assert http.post(f"/v1/sessions/{session}/chunks", json={"input": LONG_CHUNK}).status_code == 200
        with http.stream("POST", f"/v1/sessions/{session}/chunks", json={"input": "four five ", "stream": True}) as sse:
            assert sse.status_code == 200 and "[DONE]" in "".join(sse.iter_text())
        assert http.post(f"/v1/sessions/{session}/park").status_code == 200
        assert http.post(f"/v1/sessions/{session}/chunks", json={"input": "six seven "}).status_code == 200
        refused = http.post(f"/v1/sessions/{session}/chunks", json={"input": "eight", "max_tokens": 10**7})
        assert refused.status_code == 400, refused.text
        assert http.post(f"/v1/sessions/{session}/park").status_code == 200
        return str(session)


def resume_from_disk(server: RunningServer, session: str) -> None:
    """After a restart: the parked session's context comes back from the disk tier."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
        answer = http.post(f"/v1/sessions/{session}/chunks", json={"input": "nine ten "})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens_details"]["disk_tier_tokens"] > 0
        assert http.delete(f"/v1/sessions/{session}").status_code == 200


@pytest.mark.skipif(
    not Path(PROMETHEUS).exists(), reason="Prometheus (Debian package) is missing; scripts/test installs it"
)
def test_every_panel_query_returns_data(tmp_path: Path) -> None:
    settings = {"api_keys": API_KEY, "disk_tier_gib": "1", "state_dir": str(tmp_path / "state")}
    port = free_port()
    with prometheus(f"127.0.0.1:{port}", tmp_path) as url:
        with app_server("dashboard", tmp_path / "server-1.log", settings, port=port) as server:
            session = serve_sessions(server)
        with app_server("dashboard", tmp_path / "server-2.log", settings, port=port) as server:
            resume_from_disk(server, session)
            declared = httpx.get(f"{server.base_url}/metrics", timeout=10).text
            queries = dashboard_queries()
            for name in {name for expr in queries for name in metric_names(expr)}:
                family = re.sub(r"_(bucket|count|sum)$", "", name)
                assert f"# HELP {family} " in declared or f"# HELP {family.removesuffix('_total')} " in declared, (
                    f"the server does not export {name}"
                )
            served = [expr for expr in queries if not metric_names(expr) & EVENTS_NOT_SERVED]
            empty = served
            deadline = time.monotonic() + 60  # a few scrapes after the last chunk, for rate()
            while empty and time.monotonic() < deadline:
                time.sleep(2)
                empty = [expr for expr in served if not query(url, expr)]
            assert not empty, f"panel queries with no data: {empty}"
            # Negative control: a query of a metric the server does not export is empty here.
            assert not query(url, "sum(rate(streamsess_no_such_metric_total[5m]))")
