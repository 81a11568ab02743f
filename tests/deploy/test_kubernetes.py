"""The Kubernetes manifests (docker/kubernetes): rendered by kustomize (kubectl's, offline),
each object validated against the Kubernetes API's schemas in strict mode (unknown fields
fail) by kubernetes-validate, the proxy configuration they carry checked by HAProxy itself,
and the rendered copies equal to their sources. Oracles: the API's published schemas,
``haproxy -c``, and the files the copies are rendered from."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.render import FILES

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "docker" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.31"  # the oldest still supported when the manifests were written
# The Prometheus Operator's kinds: not in the API's schemas; checked for shape below.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}

requires_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def render(overlay: str, root: Path = KUBERNETES) -> list[dict[str, Any]]:
    built = subprocess.run(
        ["kubectl", "kustomize", str(root / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_strictly(overlay: str) -> None:
    objects = render(overlay)
    kinds = {obj["kind"] for obj in objects}
    assert {"StatefulSet", "Service", "Deployment", "PodDisruptionBudget", "Job", "ConfigMap"} <= kinds
    assert OPERATOR_KINDS <= kinds
    for obj in objects:
        if obj["kind"] in OPERATOR_KINDS:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["spec"]
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@requires_kubectl
def test_strict_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    """Negative control: a probe field misspelt (it would be dropped silently by a lenient apply)."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    server = copy / "base" / "server.yaml"
    server.write_text(server.read_text().replace("failureThreshold: 120", "failureTreshold: 120"))
    statefulset = by_kind(render("cpu", copy), "StatefulSet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSION, strict=True)


@requires_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_probes_and_drain(overlay: str) -> None:
    objects = render(overlay)
    statefulset = by_kind(objects, "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == server["startupProbe"]["httpGet"]["path"] == "/health"
    assert server["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    # Longer than the drain (drain_notice_s + drain_timeout_s, the defaults) and the preStop pause.
    from app.settings import Settings

    defaults = Settings(_env_file=None)
    pause = int(server["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > defaults.drain_notice_s + defaults.drain_timeout_s + pause
    env = {item["name"]: item for item in server["env"]}
    assert env["STREAMSESS_REPLICA_ID"]["value"] == "$(POD_NAME)"  # stable across restarts: the pod's name
    assert env["STREAMSESS_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "streamsess"
    assert env["STREAMSESS_STORE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "streamsess"
    assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    assert by_kind(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert server["image"] == {"cpu": "streaming-sessions:cpu", "gpu": "streaming-sessions:cuda"}[overlay]
    if overlay == "gpu":
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert env["STREAMSESS_CONNECTOR"]["value"] == "offloading"


@requires_kubectl
@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy (Debian package) is missing")
def test_the_proxy_configuration_they_carry_passes_haproxys_check(tmp_path: Path) -> None:
    objects = render("cpu")
    config_map = next(obj for obj in objects if obj["kind"] == "ConfigMap" and "haproxy.cfg" in obj["data"])
    deployment = by_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == config_map["metadata"]["name"]
    statefulset = by_kind(objects, "StatefulSet")
    config = config_map["data"]["haproxy.cfg"]
    servers = {line.split()[1] for line in config.splitlines() if line.strip().startswith("server ")}
    assert servers == {f"streamsess-{i}" for i in range(statefulset["spec"]["replicas"])}
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    env = {
        item["name"]: item.get("value", "default")
        for item in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    checked = subprocess.run(
        ["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("path", sorted(FILES), ids=lambda path: path.name)
def test_rendered_copies_match_their_sources(path: Path) -> None:
    assert path.read_text() == FILES[path](), f"{path} is stale: python -m tests.deploy.render"
