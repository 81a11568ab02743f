"""The Kubernetes manifests' copies of what the compose setup keeps elsewhere, rendered:
the proxy's configuration with the StatefulSet's pods as its servers, and the alert
rules as a PrometheusRule. ``python -m tests.deploy.render_kubernetes`` writes them;
tests/deploy/test_kubernetes.py fails when a committed copy differs from its render."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.harness.haproxy import HAPROXY_CONFIG, with_servers

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "docker" / "kubernetes" / "base"
REPLICAS = 2  # server.yaml's StatefulSet replicas
RENDERED = "# Rendered by python -m tests.deploy.render_kubernetes from {source}: edit that, then render.\n"


# Fully qualified: HAProxy's run-time resolver does not apply resolv.conf's search domains.
# The proxy's pod sets POD_NAMESPACE; a cluster domain other than cluster.local, CLUSTER_DOMAIN.
POD_ADDRESS = '"streamsess-{i}.streamsess.${{POD_NAMESPACE}}.svc.${{CLUSTER_DOMAIN}}:8000"'


def haproxy_config(replicas: int = REPLICAS) -> str:
    servers = {f"streamsess-{i}": POD_ADDRESS.format(i=i) for i in range(replicas)}
    return RENDERED.format(source="docker/haproxy/haproxy.cfg") + with_servers(HAPROXY_CONFIG.read_text(), servers)


def prometheus_rule() -> str:
    rules = yaml.safe_load((REPO / "docker" / "prometheus" / "alerts.yaml").read_text())
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "streamsess"}, "spec": rules}
    return RENDERED.format(source="docker/prometheus/alerts.yaml") + yaml.safe_dump(rule, sort_keys=False, width=100)


FILES = {BASE / "haproxy.cfg": haproxy_config, BASE / "prometheus-rule.yaml": prometheus_rule}


def main() -> None:
    for path, render in FILES.items():
        path.write_text(render())
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
