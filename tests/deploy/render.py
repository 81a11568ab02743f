"""Deployment files made from others, rendered: the Grafana dashboard (from its panels'
queries here), and the Kubernetes manifests' copies of what compose keeps elsewhere (the
proxy's configuration with the StatefulSet's pods as its servers, the alert rules as a
PrometheusRule). ``python -m tests.deploy.render`` writes them; the deploy tests fail
when a committed file differs from its render."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.harness.haproxy import HAPROXY_CONFIG, with_servers

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "docker" / "kubernetes" / "base"
REPLICAS = 2  # server.yaml's StatefulSet replicas
RENDERED = "# Rendered by python -m tests.deploy.render from {source}: edit that, then render.\n"


# Fully qualified: HAProxy's run-time resolver does not apply resolv.conf's search domains.
# The proxy's pod sets POD_NAMESPACE; a cluster domain other than cluster.local, CLUSTER_DOMAIN.
POD_ADDRESS = '"streamsess-{i}.streamsess.${{POD_NAMESPACE}}.svc.${{CLUSTER_DOMAIN}}:8000"'


def haproxy_config(replicas: int = REPLICAS) -> str:
    servers = {f"streamsess-{i}": POD_ADDRESS.format(i=i) for i in range(replicas)}
    return RENDERED.format(source="docker/haproxy/haproxy.cfg") + with_servers(HAPROXY_CONFIG.read_text(), servers)


def prometheus_rule() -> str:
    rules = yaml.safe_load((REPO / "docker" / "prometheus" / "alerts.yaml").read_text())
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "streamsess"},
        "spec": rules,
    }
    return RENDERED.format(source="docker/prometheus/alerts.yaml") + yaml.safe_dump(rule, sort_keys=False, width=100)


# The dashboard: (title, unit, [(legend, PromQL)]) a panel, in rows of (title, panels).
# Every query returns data from a server that has served sessions (tests/deploy/test_dashboard.py).
RATE = "[5m]"
DASHBOARD_ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Sessions",
        [
            (
                "Sessions open, parked, active",
                "short",
                [
                    ("open {{instance}}", "sum by (instance) (streamsess_sessions_open)"),
                    ("parked {{instance}}", "sum by (instance) (streamsess_sessions_parked)"),
                    ("active {{instance}}", "sum by (instance) (streamsess_sessions_active)"),
                ],
            ),
            (
                "Sessions created and closed per second",
                "ops",
                [
                    ("created", f"sum(rate(streamsess_sessions_created_total{RATE}))"),
                    ("closed {{reason}}", f"sum by (reason) (rate(streamsess_sessions_closed_total{RATE}))"),
                ],
            ),
            (
                "Parks by cause",
                "ops",
                [("{{reason}}", f"sum by (reason) (rate(streamsess_session_parks_total{RATE}))")],
            ),
            (
                "Resumes by source",
                "ops",
                [("{{source}}", f"sum by (source) (rate(streamsess_session_resumes_total{RATE}))")],
            ),
        ],
    ),
    (
        "Chunks",
        [
            (
                "Chunks per second by transport",
                "ops",
                [("{{transport}}", f"sum by (transport) (rate(streamsess_chunks_total{RATE}))")],
            ),
            (
                "Chunk time to first token",
                "s",
                [
                    (
                        f"p{q}",
                        f"histogram_quantile(0.{q}, sum by (le) "
                        f"(rate(streamsess_chunk_time_to_first_token_seconds_bucket{RATE})))",
                    )
                    for q in (50, 99)
                ],
            ),
            (
                "Resume time to first token (p50) by source",
                "s",
                [
                    (
                        "{{source}}",
                        "histogram_quantile(0.5, sum by (le, source) "
                        f"(rate(streamsess_resume_time_to_first_token_seconds_bucket{RATE})))",
                    )
                ],
            ),
            ("Errors by code", "ops", [("{{code}}", f"sum by (code) (rate(streamsess_chunk_errors_total{RATE}))")]),
        ],
    ),
    (
        "Cache tiers",
        [
            (
                "Prompt tokens by where their KV came from",
                "short",
                [("{{source}}", f"sum by (source) (rate(streamsess_chunk_prompt_tokens_total{RATE}))")],
            ),
            (
                "Disk tier: hits and misses per second",
                "ops",
                [
                    ("hits", f"sum(rate(vllm:kv_offload_disk_tier_hits_total{RATE}))"),
                    ("misses", f"sum(rate(vllm:kv_offload_disk_tier_misses_total{RATE}))"),
                    ("foreign hits", f"sum(rate(vllm:kv_offload_disk_tier_foreign_hits_total{RATE}))"),
                ],
            ),
            (
                "Disk tier: bytes against the cap",
                "bytes",
                [
                    ("bytes {{instance}}", "sum by (instance) (vllm:kv_offload_disk_tier_bytes)"),
                    ("cap {{instance}}", "sum by (instance) (vllm:kv_offload_disk_tier_cap_bytes)"),
                ],
            ),
            (
                "Disk tier: failed checks and vanished files per hour",
                "short",
                [
                    ("checksum failures", "sum(increase(vllm:kv_offload_disk_tier_checksum_failures_total[1h]))"),
                    ("vanished", "sum(increase(vllm:kv_offload_disk_tier_vanished_total[1h]))"),
                ],
            ),
        ],
    ),
    (
        "Store",
        [
            (
                "Store transaction time (p99) by kind",
                "s",
                [
                    (
                        "{{kind}}",
                        "histogram_quantile(0.99, sum by (le, kind) "
                        f"(rate(streamsess_store_transaction_seconds_bucket{RATE})))",
                    )
                ],
            ),
            (
                "Store transactions per second",
                "ops",
                [("{{kind}}", f"sum by (kind) (rate(streamsess_store_transaction_seconds_count{RATE}))")],
            ),
        ],
    ),
    (
        "Engine (vLLM)",
        [
            (
                "Requests running and waiting",
                "short",
                [
                    ("running {{instance}}", "sum by (instance) (vllm:num_requests_running)"),
                    ("waiting {{instance}}", "sum by (instance) (vllm:num_requests_waiting)"),
                ],
            ),
            (
                "Device KV cache usage",
                "percentunit",
                [("{{instance}}", "sum by (instance) (vllm:kv_cache_usage_perc)")],
            ),
            (
                "Tokens per second",
                "short",
                [
                    ("prompt", f"sum(rate(vllm:prompt_tokens_total{RATE}))"),
                    ("generated", f"sum(rate(vllm:generation_tokens_total{RATE}))"),
                ],
            ),
            (
                "Prefix cache hit rate",
                "percentunit",
                [
                    (
                        "device",
                        f"sum(rate(vllm:prefix_cache_hits_total{RATE})) / sum(rate(vllm:prefix_cache_queries_total{RATE}))",
                    )
                ],
            ),
        ],
    ),
]


def dashboard_queries() -> list[str]:
    return [query for _, panels in DASHBOARD_ROWS for _, _, targets in panels for _, query in targets]


def metric_names(query: str) -> set[str]:
    """The metric names a query reads (``vllm:`` and ``streamsess_`` ones)."""
    return set(re.findall(r"\b(?:vllm:|streamsess_)[a-zA-Z0-9_:]+", query))


def dashboard() -> str:
    """Grafana's dashboard JSON (schema 39), its data source a variable (provisioned or picked)."""
    panels: list[dict[str, object]] = []
    y = 0
    for row, row_panels in DASHBOARD_ROWS:
        panels.append(
            {
                "type": "row",
                "title": row,
                "id": len(panels) + 1,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        for index, (title, unit, targets) in enumerate(row_panels):
            panels.append(
                {
                    "type": "timeseries",
                    "title": title,
                    "id": len(panels) + 1,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "gridPos": {"h": 8, "w": 6, "x": 6 * (index % 4), "y": y + 8 * (index // 4)},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {
                        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"},
                    },
                    "targets": [
                        {
                            "datasource": {"type": "prometheus", "uid": "${datasource}"},
                            "expr": query,
                            "legendFormat": legend,
                            "refId": chr(ord("A") + i),
                        }
                        for i, (legend, query) in enumerate(targets)
                    ],
                }
            )
        y += 8 * ((len(row_panels) + 3) // 4)
    board = {
        "uid": "streaming-sessions",
        "title": "Streaming sessions",
        "tags": ["streaming-sessions", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }
    return json.dumps(board, indent=2) + "\n"


DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "streaming-sessions.json"
FILES = {BASE / "haproxy.cfg": haproxy_config, BASE / "prometheus-rule.yaml": prometheus_rule, DASHBOARD: dashboard}


def main() -> None:
    for path, render in FILES.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render())
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
